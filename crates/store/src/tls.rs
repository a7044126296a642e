//! HTTPS trust for the S3 client: the system roots (default), a custom CA bundle, or, only when
//! asked for explicitly, no verification at all.
//!
//! * [`TlsTrust::System`]: the platform's root certificates.
//! * [`TlsTrust::CaBundle`]: only the certificates of a PEM bundle (like `curl --cacert` or
//!   `AWS_CA_BUNDLE`): for MinIO, Ceph or a corporate proxy with a private CA.
//!   [`load_ca_bundle`] checks the file first, so a bad bundle is a clear startup error.
//! * [`TlsTrust::Insecure`]: `--no-verify-ssl`, a verifier that accepts any certificate.
//!   Traffic is still encrypted, but anyone on the path can read and change it.
//!
//! The HTTP client is hyper's, built here rather than by the SDK so that a connection's read
//! buffer is bounded ([`READ_BUF_MAX`]): hyper grows it to 408 KiB on a connection streaming
//! a GET, so 128 connections reading held 51 MiB outside the memory budget.

use aws_smithy_runtime_api::client::http::{
    HttpClient, HttpConnector, HttpConnectorFuture, HttpConnectorSettings, SharedHttpClient,
    SharedHttpConnector,
};
use aws_smithy_runtime_api::client::orchestrator::HttpRequest;
use aws_smithy_runtime_api::client::result::ConnectorError;
use aws_smithy_runtime_api::client::runtime_components::RuntimeComponents;
use aws_smithy_types::body::SdkBody;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Which server certificates the S3 client accepts.
#[derive(Debug, Clone, Default)]
pub enum TlsTrust {
    /// The platform's root certificates.
    #[default]
    System,
    /// Only certificates issued by the CAs of this PEM bundle (already checked).
    CaBundle(Vec<u8>),
    /// Any certificate (`--no-verify-ssl`).
    Insecure,
}

/// Reads a PEM bundle and checks that it holds at least one parsable certificate.
pub fn load_ca_bundle(path: &Path) -> Result<Vec<u8>, String> {
    let pem = std::fs::read(path).map_err(|e| format!("CA bundle {}: {e}", path.display()))?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| {
            format!(
                "CA bundle {}: not a PEM certificate file: {e}",
                path.display()
            )
        })?;
    if certs.is_empty() {
        return Err(format!(
            "CA bundle {}: no certificate in it (expected -----BEGIN CERTIFICATE-----)",
            path.display()
        ));
    }
    let mut roots = rustls::RootCertStore::empty();
    let (ok, bad) = roots.add_parsable_certificates(certs);
    if ok == 0 {
        return Err(format!(
            "CA bundle {}: none of its {bad} certificate(s) can be used as a CA",
            path.display()
        ));
    }
    Ok(pem)
}

/// The HTTP client for `trust`. At most `max_idle` idle connections stay open: the request
/// bound (`--max-connections`) caps connections in use, and this caps those a burst leaves
/// behind (hyper opens one when none is idle at that instant, though one may be on its way
/// back, so without it the pool creeps past the bound and keeps what it gained).
pub fn http_client(trust: &TlsTrust, max_idle: usize) -> SharedHttpClient {
    SharedHttpClient::new(StoreHttpClient::new(tls_config(trust), max_idle))
}

/// The TLS configuration of [`TlsTrust`] `trust`.
fn tls_config(trust: &TlsTrust) -> rustls::ClientConfig {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .expect("the default provider supports the default TLS versions");
    let roots = |pems: &[u8]| {
        let mut roots = rustls::RootCertStore::empty();
        roots.add_parsable_certificates(CertificateDer::pem_slice_iter(pems).flatten());
        roots
    };
    match trust {
        TlsTrust::System => {
            use hyper_rustls::ConfigBuilderExt;
            match builder.clone().with_native_roots() {
                Ok(b) => b.with_no_client_auth(),
                // No system roots (a minimal container): plain HTTP works, and an HTTPS
                // endpoint fails with "not trusted", which names --ca-bundle.
                Err(e) => {
                    tracing::debug!("system root certificates: {e}");
                    builder
                        .with_root_certificates(rustls::RootCertStore::empty())
                        .with_no_client_auth()
                }
            }
        }
        TlsTrust::CaBundle(pem) => builder
            .with_root_certificates(roots(pem))
            .with_no_client_auth(),
        TlsTrust::Insecure => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AcceptAny(provider)))
            .with_no_client_auth(),
    }
}

#[derive(Debug)]
struct AcceptAny(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AcceptAny {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

type Inner = hyper_util::client::legacy::Client<
    ConnectTimeout<
        hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    >,
    SdkBody,
>;

/// How long a new connection may take, DNS, TCP and TLS handshake together.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The most a connection's read buffer holds (hyper's default: 408 KiB). Reads of 64 KiB
/// cost no measurable CPU or speed against 408 KiB on a GET streaming at 700 MB/s.
const READ_BUF_MAX: usize = 64 << 10;

/// A connector whose connections are made within [`CONNECT_TIMEOUT`] or fail. The TCP
/// connector's own timeout ends at the TCP handshake, and hyper finishes a connect that lost
/// the race to an idle pooled connection in the background: a server that accepts and never
/// answers the TLS handshake (a load balancer without a backend) left one such task and its
/// socket behind for ever per request.
#[derive(Debug, Clone)]
struct ConnectTimeout<C>(C);

impl<C> tower_service::Service<http::Uri> for ConnectTimeout<C>
where
    C: tower_service::Service<http::Uri>,
    C::Future: Send + 'static,
    C::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Response = C::Response;
    type Error = Box<dyn std::error::Error + Send + Sync>;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<C::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connect = self.0.call(uri);
        Box::pin(async move {
            match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
                Ok(r) => r.map_err(Into::into),
                Err(_) => Err(format!(
                    "no connection within {} s (TCP and TLS handshakes)",
                    CONNECT_TIMEOUT.as_secs()
                )
                .into()),
            }
        })
    }
}

/// The HTTP client of the store (see the module's doc).
#[derive(Debug, Clone)]
struct StoreHttpClient {
    client: Inner,
}

impl StoreHttpClient {
    fn new(tls: rustls::ClientConfig, max_idle: usize) -> Self {
        let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(CONNECT_TIMEOUT));
        let https = ConnectTimeout(
            hyper_rustls::HttpsConnectorBuilder::new()
                .with_tls_config(tls)
                .https_or_http()
                .enable_http1()
                .wrap_connector(http),
        );
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(60))
                .pool_max_idle_per_host(max_idle)
                .http1_max_buf_size(READ_BUF_MAX)
                .build(https);
        Self { client }
    }
}

impl HttpConnector for StoreHttpClient {
    fn call(&self, request: HttpRequest) -> HttpConnectorFuture {
        let client = self.client.clone();
        HttpConnectorFuture::new(async move {
            let req = request
                .try_into_http1x()
                .map_err(|e| ConnectorError::user(e.into()))?;
            let resp = client.request(req).await.map_err(connector_error)?;
            let (parts, body) = resp.into_parts();
            let resp = http::Response::from_parts(parts, SdkBody::from_body_1_x(body));
            aws_smithy_runtime_api::http::Response::try_from(resp)
                .map_err(|e| ConnectorError::other(e.into(), None))
        })
    }
}

/// What the SDK's retry classifier needs of a failed request: a connection refused, reset
/// or closed midway, or an answer cut off, is worth another attempt (as the SDK's own client
/// says of them).
fn connector_error(e: hyper_util::client::legacy::Error) -> ConnectorError {
    fn source<'a, E: std::error::Error + 'static>(
        e: &'a (dyn std::error::Error + 'static),
    ) -> Option<&'a E> {
        let mut next = Some(e);
        while let Some(e) = next {
            if let Some(found) = e.downcast_ref::<E>() {
                return Some(found);
            }
            next = e.source();
        }
        None
    }
    let io = source::<std::io::Error>(&e).is_some();
    let kind: fn(_) -> ConnectorError = match source::<hyper::Error>(&e) {
        Some(h) if h.is_timeout() => ConnectorError::timeout,
        Some(h) if h.is_user() => ConnectorError::user,
        Some(h) if h.is_closed() || h.is_canceled() || io => ConnectorError::io,
        Some(h) if h.is_incomplete_message() => {
            |e| ConnectorError::other(e, Some(aws_smithy_types::retry::ErrorKind::TransientError))
        }
        None if e.is_connect() || io => ConnectorError::io,
        _ => |e| ConnectorError::other(e, None),
    };
    kind(e.into())
}

impl HttpClient for StoreHttpClient {
    fn http_connector(
        &self,
        _settings: &HttpConnectorSettings,
        _components: &RuntimeComponents,
    ) -> SharedHttpConnector {
        SharedHttpConnector::new(self.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ca_bundles_are_checked() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("ca.pem");
        assert!(load_ca_bundle(&p).unwrap_err().contains("No such file"));
        std::fs::write(&p, "hello\n").unwrap();
        let e = load_ca_bundle(&p).unwrap_err();
        assert!(e.contains("no certificate in it"), "{e}");
        std::fs::write(
            &p,
            "-----BEGIN CERTIFICATE-----\nnot base64 !!\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let e = load_ca_bundle(&p).unwrap_err();
        assert!(e.starts_with(&format!("CA bundle {}", p.display())), "{e}");
    }
}
