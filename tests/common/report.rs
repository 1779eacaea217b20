//! What a bench reports: notes and tables, printed as they come, and with `--write` (or
//! `WANOPT_BENCH_WRITE=1`) written into `benches/README.md` as that bench's section, with the
//! command, the commit and the machine, replacing the section the bench wrote before. So the
//! README holds the current figures of each bench, written by the bench itself; earlier ones are
//! in git.

#![allow(dead_code)]

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Mutex;

enum Block {
    Note(String),
    Table {
        title: String,
        header: Vec<String>,
        rows: Vec<Vec<String>>,
    },
}

static BLOCKS: Mutex<Vec<Block>> = Mutex::new(Vec::new());

fn blocks() -> std::sync::MutexGuard<'static, Vec<Block>> {
    BLOCKS.lock().unwrap_or_else(|p| p.into_inner())
}

/// A paragraph of the report (what was run, a remark on a figure).
pub fn note(text: impl Into<String>) {
    let text = text.into();
    println!("{text}");
    blocks().push(Block::Note(text));
}

/// A row of the table `title` (made with `header` at its first row).
pub fn row(title: &str, header: &[&str], cells: Vec<String>) {
    let mut b = blocks();
    let found = b.iter_mut().rev().find_map(|x| match x {
        Block::Table { title: t, rows, .. } if t == title => Some(rows),
        _ => None,
    });
    match found {
        Some(rows) => rows.push(cells.clone()),
        None => {
            println!("\n{title}\n{}", line(header.iter().map(|h| h.to_string())));
            b.push(Block::Table {
                title: title.to_string(),
                header: header.iter().map(|h| h.to_string()).collect(),
                rows: vec![cells.clone()],
            });
        }
    }
    println!("{}", line(cells.into_iter()));
}

fn line(cells: impl Iterator<Item = String>) -> String {
    let mut s = String::from("|");
    for c in cells {
        let _ = write!(s, " {} |", c.replace('|', "/"));
    }
    s
}

/// The report as markdown: notes as paragraphs, tables with their titles.
fn markdown() -> String {
    let mut out = String::new();
    for b in blocks().iter() {
        match b {
            Block::Note(t) => {
                let _ = writeln!(out, "{t}\n");
            }
            Block::Table {
                title,
                header,
                rows,
            } => {
                let _ = writeln!(out, "{title}\n");
                let _ = writeln!(out, "{}", line(header.iter().cloned()));
                let _ = writeln!(out, "{}", line(header.iter().map(|_| "---".to_string())));
                for r in rows {
                    let _ = writeln!(out, "{}", line(r.iter().cloned()));
                }
                out.push('\n');
            }
        }
    }
    out
}

/// The bench's name: its executable's, without the hash cargo adds.
fn bench_name() -> String {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .map(|s| s.rsplit_once('-').map_or(s.clone(), |(n, _)| n.to_string()))
        .unwrap_or_default()
}

fn command() -> String {
    let bench = bench_name();
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench" && a != "--write")
        .collect();
    if args.is_empty() {
        format!("cargo bench --bench {bench}")
    } else {
        format!("cargo bench --bench {bench} -- {}", args.join(" "))
    }
}

fn output(cmd: &str, args: &[&str]) -> Option<String> {
    let o = std::process::Command::new(cmd).args(args).output().ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

fn commit() -> String {
    let root = env!("CARGO_MANIFEST_DIR");
    let Some(c) = output("git", &["-C", root, "rev-parse", "--short", "HEAD"]) else {
        return "unknown (no git)".into();
    };
    // What the benches write themselves does not count.
    let dirty = output(
        "git",
        &[
            "-C",
            root,
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
            ".",
            ":!benches/README.md",
            ":!benches/charts",
        ],
    )
    .is_some_and(|s| !s.is_empty());
    if dirty {
        format!("`{c}` with uncommitted changes")
    } else {
        format!("`{c}`")
    }
}

fn machine() -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, m)| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let kernel = output("uname", &["-r"]).unwrap_or_default();
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .next()
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|k| k.parse::<u64>().ok())
        })
        .map_or(String::new(), |kb| {
            format!(", {} GiB", (kb + (1 << 19)) >> 20)
        });
    format!("{cores} cores ({cpu}){mem}, Linux {kernel}")
}

fn today() -> String {
    output("date", &["-u", "+%Y-%m-%d"]).unwrap_or_default()
}

/// Ends the report: with `--write` (or `WANOPT_BENCH_WRITE=1`), the section `bench` of
/// `benches/README.md` (between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`; a bench with
/// several modes has a section per mode) is replaced by this run's, or added at the end.
pub fn finish(bench: &str, title: &str) {
    let wanted = std::env::args().any(|a| a == "--write")
        || std::env::var("WANOPT_BENCH_WRITE").as_deref() == Ok("1");
    if !wanted {
        return;
    }
    let section = format!(
        "<!-- bench:{bench} -->\n## {title}\n\n`{}`, commit {}, {}, {}.\n\n{}<!-- /bench:{bench} -->\n",
        command(),
        commit(),
        machine(),
        today(),
        markdown()
    );
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/README.md");
    let old = std::fs::read_to_string(&path).unwrap_or_default();
    let (open, close) = (
        format!("<!-- bench:{bench} -->"),
        format!("<!-- /bench:{bench} -->\n"),
    );
    let new = match (old.find(&open), old.find(&close)) {
        (Some(a), Some(b)) if a < b => format!("{}{section}{}", &old[..a], &old[b + close.len()..]),
        _ => format!(
            "{}\n{section}",
            old.trim_end_matches('\n').to_string() + "\n"
        ),
    };
    match std::fs::write(&path, new) {
        Ok(()) => println!("\nwritten to {}", path.display()),
        Err(e) => eprintln!("cannot write {}: {e}", path.display()),
    }
}
