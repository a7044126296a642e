//! `bucketfs install`: lays out what a package would, under a root: the binary, the
//! `mount.bucketfs` helper link (so fstab lines of type `bucketfs` mount), the man page built
//! to roff from docs/bucketfs.1.md, bash/zsh/fish completions, a systemd unit template, and
//! with `--s3fs-links` links named `s3fs`, `ossfs` and `ossfs2` (their command lines, and fstab
//! lines written for s3fs, then run bucketfs).

use crate::args::{Cli, InstallArgs};
use clap::CommandFactory;
use clap_complete::Shell;
use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

const MAN_PAGE: &str = include_str!("../../../docs/bucketfs.1.md");

/// `bucketfs@.service`: `systemctl enable --now bucketfs@mnt-data` mounts /mnt/data with the
/// config file /etc/bucketfs/mnt-data.conf (TOML or ossfs 2.0; it names the bucket). The log
/// goes to the journal (plain text: stderr is not a terminal). `Type=notify`: the daemon says
/// when the mount is ready, so `systemctl start` fails when the mount does (a bad credential,
/// a missing bucket) and units ordered after it find it mounted.
const UNIT_TEMPLATE: &str = "\
[Unit]
Description=bucketfs mount of %f
Documentation=man:bucketfs(1)
Wants=network-online.target
After=network-online.target
RequiresMountsFor=%f

[Service]
Type=notify
NotifyAccess=main
# Files a crash left to upload go up before the mount is ready (progress in the journal):
# that may take longer than systemd's default start timeout.
TimeoutStartSec=infinity
ExecStart=@BIN@ mount -f %f -c /etc/bucketfs/%i.conf
ExecStop=@BIN@ umount --lazy %f
# Files still open at stop are uploaded at their close; give them time.
TimeoutStopSec=300
Restart=on-failure

[Install]
WantedBy=multi-user.target
";

/// Runs `bucketfs install`; returns the exit code.
pub fn run(args: &InstallArgs) -> i32 {
    match install(args) {
        Ok(paths) => {
            for p in paths {
                println!("installed {}", p.display());
            }
            0
        }
        Err(msg) => {
            eprintln!("bucketfs: install: {msg}");
            1
        }
    }
}

/// `path` (absolute, as on the installed system) under `root`.
fn under(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

fn write(path: &Path, data: &[u8], mode: u32) -> Result<(), String> {
    let err = |e: std::io::Error| format!("{}: {e}", path.display());
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(err)?;
    }
    // Written beside and renamed, so a running binary being replaced is never half written.
    let tmp = path.with_extension("bucketfs-install-tmp");
    let mut f = fs::File::create(&tmp).map_err(err)?;
    f.write_all(data).map_err(err)?;
    f.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(err)?;
    f.sync_all().map_err(err)?;
    fs::rename(&tmp, path).map_err(err)
}

/// A symlink at `link` to `target`, replacing an older link but never a file.
fn symlink(target: &Path, link: &Path) -> Result<(), String> {
    let err = |e: std::io::Error| format!("{}: {e}", link.display());
    if let Some(dir) = link.parent() {
        fs::create_dir_all(dir).map_err(err)?;
    }
    match fs::symlink_metadata(link) {
        Ok(md) if md.file_type().is_symlink() => fs::remove_file(link).map_err(err)?,
        Ok(_) => {
            return Err(format!(
                "{} exists and is not a link: not replacing it",
                link.display()
            ))
        }
        Err(_) => {}
    }
    std::os::unix::fs::symlink(target, link).map_err(err)
}

fn install(args: &InstallArgs) -> Result<Vec<PathBuf>, String> {
    if !args.prefix.is_absolute() {
        return Err(format!(
            "--prefix {} is not absolute",
            args.prefix.display()
        ));
    }
    let root = &args.root;
    let prefix = &args.prefix;
    let bin = prefix.join("bin/bucketfs");
    let mut done = Vec::new();

    let exe = match &args.binary {
        Some(b) => b.clone(),
        None => std::env::current_exe().map_err(|e| format!("own binary: {e}"))?,
    };
    let data = fs::read(&exe).map_err(|e| format!("{}: {e}", exe.display()))?;
    let p = under(root, &bin);
    write(&p, &data, 0o755)?;
    done.push(p);

    let p = under(root, &args.sbin.join("mount.bucketfs"));
    symlink(&bin, &p)?;
    done.push(p);

    let p = under(root, &prefix.join("share/man/man1/bucketfs.1"));
    write(&p, man_to_roff(MAN_PAGE).as_bytes(), 0o644)?;
    done.push(p);

    for (shell, path) in [
        (Shell::Bash, "share/bash-completion/completions/bucketfs"),
        (Shell::Zsh, "share/zsh/site-functions/_bucketfs"),
        (Shell::Fish, "share/fish/vendor_completions.d/bucketfs.fish"),
    ] {
        let mut buf = Vec::new();
        clap_complete::generate(shell, &mut Cli::command(), "bucketfs", &mut buf);
        let p = under(root, &prefix.join(path));
        write(&p, &buf, 0o644)?;
        done.push(p);
    }

    let unit = UNIT_TEMPLATE.replace("@BIN@", &bin.display().to_string());
    let p = under(root, &prefix.join("lib/systemd/system/bucketfs@.service"));
    write(&p, unit.as_bytes(), 0o644)?;
    done.push(p);

    if args.s3fs_links {
        for name in ["s3fs", "ossfs", "ossfs2"] {
            let p = under(root, &prefix.join("bin").join(name));
            symlink(Path::new("bucketfs"), &p)?;
            done.push(p);
        }
    }
    Ok(done)
}

/// Roff text: backslashes and hyphens (so `--flag` stays ASCII) escaped.
fn escape(s: &str) -> String {
    s.replace('\\', "\\e").replace('-', "\\-")
}

/// A text line that does not start with a roff control character.
fn text_line(t: String) -> String {
    if t.starts_with('.') || t.starts_with('\'') {
        format!("\\&{t}")
    } else {
        t
    }
}

/// Inline markdown of the man page: `code` and **bold** in bold, *text* in italics,
/// [text](link) as its text.
fn inline(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find(['`', '*', '[']) {
        out.push_str(&escape(&rest[..i]));
        let r = &rest[i..];
        let (open, close, font) = if r.starts_with('`') {
            ("`", "`", "B")
        } else if r.starts_with("**") {
            ("**", "**", "B")
        } else if r.starts_with('*') {
            ("*", "*", "I")
        } else {
            ("[", "](", "")
        };
        let body = &r[open.len()..];
        match body.find(close) {
            Some(end) if end > 0 => {
                let text = &body[..end];
                let after = &body[end + close.len()..];
                if font.is_empty() {
                    out.push_str(&inline(text));
                    rest = after.find(')').map_or("", |e| &after[e + 1..]);
                } else {
                    let text = if open == "`" {
                        escape(text)
                    } else {
                        inline(text)
                    };
                    out.push_str(&format!("\\f{font}{text}\\fR"));
                    rest = after;
                }
            }
            _ => {
                out.push_str(&escape(open));
                rest = &r[open.len()..];
            }
        }
    }
    out.push_str(&escape(rest));
    out
}

/// The man page's markdown (headings, paragraphs, `term` + `:   definition` lists, `*` lists,
/// fenced code) as man(7) roff.
pub fn man_to_roff(md: &str) -> String {
    let mut out = String::new();
    let mut lines = md.lines().peekable();
    let mut in_code = false;
    while let Some(line) = lines.next() {
        if line.starts_with("```") {
            out.push_str(if in_code {
                ".fi\n.RE\n"
            } else {
                ".RS 4\n.nf\n"
            });
            in_code = !in_code;
            continue;
        }
        if in_code {
            out.push_str(&text_line(escape(line)));
            out.push('\n');
            continue;
        }
        if let Some(title) = line.strip_prefix("# ") {
            let name = title.split('(').next().unwrap_or(title).trim();
            out.push_str(&format!(
                ".TH {name} 1 \"\" \"bucketfs {}\" \"User Commands\"\n",
                env!("CARGO_PKG_VERSION")
            ));
        } else if let Some(h) = line.strip_prefix("## ") {
            out.push_str(&format!(".SH {}\n", escape(h)));
        } else if line.trim().is_empty() {
            continue;
        } else if let Some(item) = line.strip_prefix("* ") {
            let mut text = item.to_string();
            while let Some(l) = lines.next_if(|l| l.starts_with("  ") && !l.trim().is_empty()) {
                text.push(' ');
                text.push_str(l.trim());
            }
            out.push_str(&format!(".IP \\(bu 2\n{}\n", text_line(inline(&text))));
        } else if lines.peek().is_some_and(|l| l.starts_with(":   ")) {
            let mut body = String::new();
            while let Some(l) = lines.next_if(|l| l.starts_with(":   ") || l.starts_with("    ")) {
                body.push_str(l[4..].trim());
                body.push(' ');
            }
            out.push_str(&format!(
                ".TP\n{}\n{}\n",
                text_line(inline(line)),
                text_line(inline(body.trim_end()))
            ));
        } else {
            let mut text = line.trim().to_string();
            while let Some(l) = lines.next_if(|l| {
                !l.trim().is_empty()
                    && !l.starts_with('#')
                    && !l.starts_with("```")
                    && !l.starts_with("* ")
            }) {
                text.push(' ');
                text.push_str(l.trim());
            }
            out.push_str(&format!(".PP\n{}\n", text_line(inline(&text))));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_markup() {
        assert_eq!(
            inline("use `--part-size` with **care**, *SIZE* [docs](x.md)."),
            "use \\fB\\-\\-part\\-size\\fR with \\fBcare\\fR, \\fISIZE\\fR docs."
        );
        assert_eq!(inline("a * b"), "a * b");
        assert_eq!(text_line(escape(".x\\y")), "\\&.x\\ey");
    }

    #[test]
    fn man_page_structure() {
        let roff = man_to_roff(MAN_PAGE);
        assert!(roff.starts_with(".TH BUCKETFS 1 "), "{}", &roff[..80]);
        for section in [
            "NAME",
            "SYNOPSIS",
            "OPTIONS",
            "CONFIG FILE",
            "FILES",
            "SEE ALSO",
        ] {
            assert!(roff.contains(&format!("\n.SH {section}\n")), "{section}");
        }
        assert!(roff.contains(".TP\n\\fB\\-\\-part\\-size\\fR \\fISIZE\\fR"));
        assert!(!roff.contains("```") && !roff.contains("**") && !roff.contains("]("));
        assert!(!roff.lines().any(|l| l.starts_with(':')));
    }
}
