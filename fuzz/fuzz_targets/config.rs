//! Fuzzes the config parser (TOML and ossfs 2.0 formats, every key's value parser): no input
//! may panic, every error must be one line, and a credential value must never be echoed.
#![no_main]

use libfuzzer_sys::fuzz_target;

// The parser lives in the `bucketfs` binary crate; compile its module here.
#[allow(dead_code)]
#[path = "../../crates/cli/src/config.rs"]
mod config;

const SECRET: &str = "Zx9SECRETsecret42";

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = config::parse_config_text(text, std::path::Path::new("/fuzz.toml"));
    let _ = config::parse_size(text);
    let _ = config::parse_duration(text);
    let _ = config::parse_mode(text);
    let _ = config::parse_source(text);
    let mut s = config::Settings::default();
    let _ = s.apply_mount_options(&[text.to_string()]);
    // The same text as a private config file, with a credential appended.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.toml");
    let body = if text.trim_start().starts_with("--") {
        format!("{text}\n--oss_access_key_secret={SECRET}\n")
    } else {
        format!("{text}\nsecret_access_key = \"{SECRET}\"\n")
    };
    std::fs::write(&p, body).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut s = config::Settings::default();
    if let Err(e) = s.apply_file(&p) {
        assert!(!e.contains('\n'), "multi-line error: {e:?}");
        assert!(!e.contains(SECRET), "secret echoed: {e:?}");
    }
});
