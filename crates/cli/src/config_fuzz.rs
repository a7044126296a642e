//! Property tests ("fuzzing" in the normal test run) of everything that parses user input:
//! config files in both formats, `-o` option lists, sizes, durations, modes and sources. None
//! may panic on any input; every error is one line that names its origin; a secret given in
//! a config file never appears in an error. `fuzz/` has cargo-fuzz targets for longer runs.

use crate::config::*;
use crate::options::OPTIONS;
use proptest::prelude::*;
use std::io::Write;
use std::path::Path;

const SECRET: &str = "Zx9SECRETsecret42";

fn one_line(e: &str) -> bool {
    !e.contains('\n') && !e.is_empty()
}

/// Config-file-like text: every key of the table, ossfs keys, near-miss keys and junk, with
/// odd values.
fn config_text() -> impl Strategy<Value = String> {
    let key = prop_oneof![
        prop::sample::select(
            OPTIONS
                .iter()
                .map(|o| o.key)
                .chain([
                    "oss_endpoint",
                    "oss_access_key_secret",
                    "log_dir",
                    "part-size",
                    "PART_SIZE",
                    "bogus",
                ])
                .collect::<Vec<_>>(),
        )
        .prop_map(str::to_string),
        "[a-z_\\-]{0,12}",
    ];
    let value = prop_oneof![
        "[0-9]{0,25}[kKmMgGtTiB.]{0,3}",
        "-?[0-9]{1,5}(\\.[0-9]{0,3})?(ms|s|m|h)?",
        "0o?[0-7]{0,6}",
        "(true|false|yes|no|on|off|auto|maybe)",
        "https?://[a-z0-9.:]{0,20}",
        "\\PC{0,20}",
    ];
    let line = (key, value, 0u8..6)
        .prop_map(|(k, v, style)| {
            // Credentials always carry the secret (and nothing else does), so an error that
            // echoes a value can be told apart from one that leaks a credential.
            let secret = [
                "access_key_id",
                "secret_access_key",
                "session_token",
                "oss_access_key_secret",
            ]
            .contains(&k.as_str());
            let v = if secret {
                SECRET.to_string()
            } else {
                v.replace(SECRET, "")
            };
            (k, v, style)
        })
        .prop_map(|(k, v, style)| match style {
            0 => format!("{k} = \"{v}\""),
            1 => format!("{k} = {v}"),
            2 => format!("--{k}={v}"),
            3 => format!("--{k}"),
            4 => format!("# {k} {v}"),
            _ => format!("{k}{v}"),
        });
    prop::collection::vec(line, 0..8).prop_map(|l| l.join("\n"))
}

fn write_private(text: &str) -> tempfile::NamedTempFile {
    use std::os::unix::fs::PermissionsExt;
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(text.as_bytes()).unwrap();
    std::fs::set_permissions(f.path(), std::fs::Permissions::from_mode(0o600)).unwrap();
    f
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn config_files_never_panic_and_errors_are_one_line(text in config_text()) {
        let f = write_private(&text);
        let mut s = Settings::default();
        if let Err(e) = s.apply_file(f.path()) {
            prop_assert!(one_line(&e), "{:?}", e);
            prop_assert!(e.starts_with(&format!("config {}", f.path().display())), "{:?}", e);
            prop_assert!(!e.contains(SECRET), "secret in error: {:?}", e);
        }
        let dbg = format!("{s:?}");
        for (field, set) in [
            ("access_key_id", s.access_key_id.is_some()),
            ("secret_access_key", s.secret_access_key.is_some()),
            ("session_token", s.session_token.is_some()),
        ] {
            if set {
                let shown = format!("{field}: Some(\"<hidden>\")");
                prop_assert!(dbg.contains(&shown), "{} shown in Debug: {}", field, dbg);
            }
        }
    }

    #[test]
    fn arbitrary_text_never_panics(text in "\\PC{0,300}") {
        let _ = parse_config_text(&text, Path::new("/x.toml"));
        let _ = parse_size(&text);
        let _ = parse_duration(&text);
        if let Ok(m) = parse_mode(&text) {
            prop_assert!(m <= 0o7777);
        }
        let _ = parse_bool(&text);
        let _ = parse_log_level(&text);
        let _ = parse_source(&text);
        let opts = vec![text.clone()];
        let _ = split_mount_options(&opts);
        let _ = config_from_mount_options(&opts);
        let mut s = Settings::default();
        if let Err(e) = s.apply_mount_options(&opts) {
            prop_assert!(one_line(&e) || text.contains('\n'), "{:?}", e);
        }
    }

    #[test]
    fn sizes_parse_exactly_or_fail(n in 0u64..1 << 44, unit in 0usize..6) {
        let (suffix, mult) = [("", 1u64), ("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30),
            ("T", 1 << 40), ("MiB", 1 << 20)][unit];
        let r = parse_size(&format!("{n}{suffix}"));
        match n.checked_mul(mult) {
            Some(v) => prop_assert_eq!(r, Ok(v)),
            None => prop_assert!(r.is_err()),
        }
    }

    #[test]
    fn credentials_are_refused_outside_the_file(
        key in prop::sample::select(vec!["access_key_id", "secret_access_key", "session_token",
            "secret-access-key", "SECRET_ACCESS_KEY"]),
    ) {
        let mut s = Settings::default();
        let e = s.apply_mount_options(&[format!("{key}={SECRET}")]).unwrap_err();
        prop_assert!(e.contains("not accepted"), "{}", e);
        prop_assert!(!e.contains(SECRET));
    }
}
