//! An endpoint given by `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` (not `--endpoint-url`) is
//! the one the store names:
//! the data cache keys its blocks and saved pages by it, so two such endpoints serving one
//! bucket name never share them (an earlier build called both "aws"). A test binary of its
//! own: it sets the variable before anything reads it.

use bucketfs_store::list_meta::ListMetadata;
use bucketfs_store::s3::{S3Config, S3Store};
use bucketfs_store::tls::TlsTrust;

#[tokio::test]
async fn an_endpoint_from_the_environment_is_the_one_named() {
    // Alone in this process: no other thread reads the environment yet. The S3 one wins,
    // as in the SDK's own clients.
    std::env::set_var("AWS_ENDPOINT_URL", "http://127.0.0.1:3");
    std::env::set_var("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:1");
    let cfg = S3Config {
        bucket: "b".into(),
        endpoint_url: None,
        region: Some("us-east-1".into()),
        force_path_style: true,
        profile: None,
        access_key_id: Some("a".into()),
        secret_access_key: Some("s".into()),
        session_token: None,
        max_attempts: 1,
        tls: TlsTrust::System,
        unsigned_payload: None,
        list_metadata: ListMetadata::Auto,
        max_connections: 0,
        guess_content_type: false,
    };
    let s = S3Store::new(&cfg).await.unwrap();
    assert_eq!(s.endpoint(), Some("http://127.0.0.1:1"));
    let given = S3Config {
        endpoint_url: Some("http://127.0.0.1:2".into()),
        ..cfg
    };
    let s = S3Store::new(&given).await.unwrap();
    assert_eq!(s.endpoint(), Some("http://127.0.0.1:2"), "the option wins");
}
