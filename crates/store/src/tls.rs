//! HTTPS trust for the S3 client: the system roots (default), a custom CA bundle, or, only when
//! asked for explicitly, no verification at all.
//!
//! * [`TlsTrust::System`]: the SDK's own HTTPS client and the platform's root certificates.
//! * [`TlsTrust::CaBundle`]: the SDK's HTTPS client trusting only the certificates of a PEM
//!   bundle (like `curl --cacert` or `AWS_CA_BUNDLE`): for MinIO, Ceph or a corporate proxy
//!   with a private CA. [`load_ca_bundle`] checks the file first, so a bad bundle is a clear
//!   startup error (the SDK itself panics on unparsable PEM).
//! * [`TlsTrust::Insecure`]: `--no-verify-ssl`. The SDK cannot switch verification off, so
//!   this is a small HTTP client of its own (hyper + rustls with a verifier that accepts any
//!   certificate). Traffic is still encrypted, but anyone on the path can read and change it.

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
    use aws_smithy_http_client::tls::{self, TlsContext, TrustStore};
    let builder = aws_smithy_http_client::Builder::new()
        .pool_max_idle_per_host(max_idle)
        .tls_provider(tls::Provider::rustls(
            tls::rustls_provider::CryptoMode::AwsLc,
        ));
    match trust {
        // The SDK's default client, but for the idle bound.
        TlsTrust::System => builder.build_https(),
        TlsTrust::CaBundle(pem) => {
            let ctx = TlsContext::builder()
                .with_trust_store(
                    TrustStore::empty()
                        .with_native_roots(false)
                        .with_pem_certificate(pem.clone()),
                )
                .build()
                .expect("a TLS context without server names always builds");
            builder.tls_context(ctx).build_https()
        }
        TlsTrust::Insecure => SharedHttpClient::new(InsecureClient::new(max_idle)),
    }
}

/// Accepts every server certificate (signatures are still checked, so the session is
/// encrypted to whoever answered).
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

/// The `--no-verify-ssl` HTTP client.
#[derive(Debug, Clone)]
struct InsecureClient {
    client: Inner,
}

impl InsecureClient {
    fn new(max_idle: usize) -> Self {
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .expect("the default provider supports the default TLS versions")
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AcceptAny(provider)))
            .with_no_client_auth();
        let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(CONNECT_TIMEOUT));
        let https = ConnectTimeout(
            hyper_rustls::HttpsConnectorBuilder::new()
                .with_tls_config(config)
                .https_or_http()
                .enable_http1()
                .wrap_connector(http),
        );
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(60))
                .pool_max_idle_per_host(max_idle)
                .build(https);
        Self { client }
    }
}

impl HttpConnector for InsecureClient {
    fn call(&self, request: HttpRequest) -> HttpConnectorFuture {
        let client = self.client.clone();
        HttpConnectorFuture::new(async move {
            let req = request
                .try_into_http1x()
                .map_err(|e| ConnectorError::user(e.into()))?;
            let resp = client.request(req).await.map_err(|e| {
                if e.is_connect() {
                    ConnectorError::io(e.into())
                } else {
                    ConnectorError::other(e.into(), None)
                }
            })?;
            let (parts, body) = resp.into_parts();
            let resp = http::Response::from_parts(parts, SdkBody::from_body_1_x(body));
            aws_smithy_runtime_api::http::Response::try_from(resp)
                .map_err(|e| ConnectorError::other(e.into(), None))
        })
    }
}

impl HttpClient for InsecureClient {
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
