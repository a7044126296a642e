//! Progress of S3 requests on the wire, for the stall bound of [`crate::retry`]: an SDK
//! interceptor that notes each slice of a request body the HTTP client takes to send, the
//! head of a successful answer, and each frame of its body, on the attempt's
//! [`AttemptProgress`]. An error answer (a 503 storm) is not progress.

use crate::liveness::{self, AttemptProgress};
use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::interceptors::context::{
    BeforeDeserializationInterceptorContextMut, BeforeTransmitInterceptorContextMut,
};
use aws_smithy_runtime_api::client::interceptors::Intercept;
use aws_smithy_runtime_api::client::runtime_components::RuntimeComponents;
use aws_smithy_types::body::SdkBody;
use aws_smithy_types::config_bag::ConfigBag;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// Request bodies are handed to the HTTP client in slices of this size, so that progress is
/// noted as the socket takes them (a part is otherwise one 8 MiB frame, noted once).
const SLICE: usize = 256 * 1024;

#[derive(Debug)]
pub struct Progress;

impl Intercept for Progress {
    fn name(&self) -> &'static str {
        "bucketfs::Progress"
    }

    fn modify_before_transmit(
        &self,
        context: &mut BeforeTransmitInterceptorContextMut<'_>,
        _rc: &RuntimeComponents,
        _cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let Some(p) = AttemptProgress::current() else {
            return Ok(());
        };
        let body = context.request_mut().take_body();
        *context.request_mut().body_mut() =
            body.map_preserve_contents(move |b| counted(b, p.clone()));
        Ok(())
    }

    fn modify_before_deserialization(
        &self,
        context: &mut BeforeDeserializationInterceptorContextMut<'_>,
        _rc: &RuntimeComponents,
        _cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        if !context.response().status().is_success() {
            return Ok(());
        }
        let Some(p) = AttemptProgress::current() else {
            return Ok(());
        };
        liveness::tick();
        let body = context.response_mut().take_body();
        *context.response_mut().body_mut() = counted(body, p);
        Ok(())
    }
}

fn counted(inner: SdkBody, progress: Arc<AttemptProgress>) -> SdkBody {
    SdkBody::from_body_1_x(Counted {
        inner: Box::pin(inner),
        pending: Bytes::new(),
        progress,
    })
}

/// A body that notes progress for each slice it yields.
struct Counted {
    inner: Pin<Box<SdkBody>>,
    /// The rest of the inner body's last data frame.
    pending: Bytes,
    progress: Arc<AttemptProgress>,
}

impl Body for Counted {
    type Data = Bytes;
    type Error = aws_smithy_types::body::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        loop {
            if !this.pending.is_empty() {
                let n = this.pending.len().min(SLICE);
                let slice = this.pending.split_to(n);
                this.progress.tick();
                return Poll::Ready(Some(Ok(Frame::data(slice))));
            }
            match this.inner.as_mut().poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => this.pending = data,
                    Err(other) => return Poll::Ready(Some(Ok(other))),
                },
                other => return other,
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.pending.is_empty() && Body::is_end_stream(&*self.inner)
    }

    fn size_hint(&self) -> SizeHint {
        let inner = Body::size_hint(&*self.inner);
        let extra = self.pending.len() as u64;
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower() + extra);
        if let Some(u) = inner.upper() {
            hint.set_upper(u + extra);
        }
        hint
    }
}
