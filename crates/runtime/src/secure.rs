//! Trust in local files: key files must be private to their owner, the state directory must be
//! writable by nobody but this daemon's user (or root), and files in it are opened without
//! following symlinks, so a local user cannot steer a root-run daemon's writes elsewhere.

use std::fs::{DirBuilder, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

/// Open options that refuse a symlink as the last path component.
pub fn no_follow() -> OpenOptions {
    let mut o = OpenOptions::new();
    o.custom_flags(libc::O_NOFOLLOW);
    o
}

/// Refuses a key file that its group or others may read or write.
pub fn private_key_file(path: &Path) -> Result<(), String> {
    let m = std::fs::metadata(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mode = m.mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "{} is open to group or others (mode {mode:03o}); keep keys private: chmod 600 {}",
            path.display(),
            path.display()
        ));
    }
    Ok(())
}

/// Creates the state directory (0700) if it does not exist; refuses one that is not a directory,
/// belongs to someone other than this user or root, or that group or others may write.
pub fn state_dir(path: &Path) -> Result<(), String> {
    let euid = unsafe { libc::geteuid() };
    // Checked before anything is created in it.
    trusted_ancestors(path, &|uid| uid == euid || uid == 0)?;
    if !exists(path)? {
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(path)
            .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    }
    trusted_dir(
        path,
        &|uid| uid == euid || uid == 0,
        &format!("this daemon's user (uid {euid}) or root"),
    )
}

/// What [`state_dir_as_found`] could judge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// Not there yet: the daemon creates it.
    Missing,
    /// Type, owner and mode are what the daemon accepts when run as this user.
    Checked,
    /// Run as root: type and mode checked, the owner not (the daemon's user is unknown here).
    OwnerUnknown,
}

/// What `wanoptd check` can say of a state directory without creating it; an error for what the
/// daemon would refuse.
pub fn state_dir_as_found(path: &Path) -> Result<Found, String> {
    if !exists(path)? {
        return Ok(Found::Missing);
    }
    let euid = unsafe { libc::geteuid() };
    if euid == 0 {
        trusted_dir(path, &|_| true, "anyone")?;
        return Ok(Found::OwnerUnknown);
    }
    trusted_dir(
        path,
        &|uid| uid == euid || uid == 0,
        &format!("this user (uid {euid}) or root"),
    )?;
    Ok(Found::Checked)
}

fn exists(path: &Path) -> Result<bool, String> {
    match std::fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// Every directory above `path` must be writable only by a trusted owner (or be sticky, as
/// `/tmp` is): otherwise someone else could move the state directory away and put theirs in
/// its place after it was checked.
fn trusted_ancestors(path: &Path, trusted: &dyn Fn(u32) -> bool) -> Result<(), String> {
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(|e| format!("{}: {e}", path.display()))?
            .join(path)
    };
    for dir in abs.ancestors().skip(1) {
        let Ok(m) = std::fs::metadata(dir) else {
            continue;
        };
        let mode = m.mode() & 0o7777;
        let sticky = mode & 0o1000 != 0;
        let writable_by_others = mode & 0o022 != 0;
        if writable_by_others && !sticky {
            return Err(format!(
                "{} is inside {}, which group or others may write (mode {mode:03o}): they could swap the state directory; chmod go-w {}",
                path.display(),
                dir.display(),
                dir.display()
            ));
        }
        // A shared sticky directory (/tmp) is safe whoever owns it; any other is only as safe
        // as its owner, who may rename what is in it.
        let owner_may_swap = mode & 0o200 != 0 && !(writable_by_others && sticky);
        if owner_may_swap && !trusted(m.uid()) {
            return Err(format!(
                "{} is inside {}, owned by uid {}, who could swap the state directory",
                path.display(),
                dir.display(),
                m.uid()
            ));
        }
    }
    Ok(())
}

fn trusted_dir(path: &Path, trusted: &dyn Fn(u32) -> bool, who: &str) -> Result<(), String> {
    trusted_ancestors(path, trusted)?;
    let shown = path.display();
    let link = std::fs::symlink_metadata(path).map_err(|e| format!("{shown}: {e}"))?;
    if link.file_type().is_symlink() && !trusted(link.uid()) {
        return Err(format!(
            "{shown} is a symlink owned by uid {}, not by {who}",
            link.uid()
        ));
    }
    let m = std::fs::metadata(path).map_err(|e| format!("{shown}: {e}"))?;
    if !m.is_dir() {
        return Err(format!("{shown} is not a directory"));
    }
    if !trusted(m.uid()) {
        return Err(format!("{shown} is owned by uid {}, not by {who}", m.uid()));
    }
    let mode = m.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(format!(
            "{shown} may be written by group or others (mode {mode:03o}); chmod 700 {shown}"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn chmod(p: &Path, mode: u32) {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }

    #[test]
    fn key_files_must_be_private() {
        let d = tempfile::tempdir().expect("tempdir");
        let k = d.path().join("k");
        std::fs::write(&k, [1u8; 32]).expect("write");
        for (mode, ok) in [(0o600, true), (0o400, true), (0o640, false), (0o604, false)] {
            chmod(&k, mode);
            let r = private_key_file(&k);
            assert_eq!(r.is_ok(), ok, "{mode:o}: {r:?}");
        }
        assert!(private_key_file(&d.path().join("none")).is_err());
    }

    #[test]
    fn a_state_dir_is_created_private_and_checked() {
        let d = tempfile::tempdir().expect("tempdir");
        let s = d.path().join("a/state");
        state_dir(&s).expect("created");
        let mode = std::fs::metadata(&s).expect("meta").mode() & 0o777;
        assert_eq!(mode, 0o700);
        state_dir(&s).expect("reused");
        chmod(&s, 0o777);
        let e = state_dir(&s).expect_err("world-writable");
        assert!(e.contains("chmod 700"), "{e}");
        chmod(&s, 0o755);
        state_dir(&s).expect("others may read");
        let f = d.path().join("file");
        std::fs::write(&f, b"x").expect("write");
        assert!(state_dir(&f).expect_err("file").contains("not a directory"));
        // Our own symlink to our own directory is fine.
        let l = d.path().join("link");
        std::os::unix::fs::symlink(&s, &l).expect("symlink");
        state_dir(&l).expect("own symlink");
        // A parent others may write (not sticky) could swap it; a sticky one (as /tmp) cannot.
        let open_parent = d.path().join("open");
        std::fs::create_dir(&open_parent).expect("mkdir");
        chmod(&open_parent, 0o777);
        let e = state_dir(&open_parent.join("state")).expect_err("a parent others may write");
        assert!(e.contains("chmod go-w"), "{e}");
        chmod(&open_parent, 0o1777);
        state_dir(&open_parent.join("state")).expect("a sticky parent");
        // The check's view: the same verdicts, and nothing created.
        assert!(matches!(
            state_dir_as_found(&s),
            Ok(Found::Checked | Found::OwnerUnknown)
        ));
        let missing = d.path().join("not/yet");
        assert_eq!(state_dir_as_found(&missing), Ok(Found::Missing));
        assert!(!missing.exists());
        chmod(&s, 0o777);
        assert!(
            state_dir_as_found(&s)
                .expect_err("world-writable")
                .contains("chmod 700")
        );
        chmod(&s, 0o700);
        // Someone else's directory is refused (only root can make one here).
        if unsafe { libc::geteuid() } == 0 {
            let theirs = d.path().join("theirs");
            std::fs::create_dir(&theirs).expect("mkdir");
            chmod(&theirs, 0o700);
            std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).expect("chown");
            let e = state_dir(&theirs).expect_err("foreign owner");
            assert!(e.contains("owned by uid 65534"), "{e}");
        }
    }

    #[test]
    fn files_are_not_opened_through_symlinks() {
        let d = tempfile::tempdir().expect("tempdir");
        let target = d.path().join("target");
        std::fs::write(&target, b"keep").expect("write");
        let l = d.path().join("seg");
        std::os::unix::fs::symlink(&target, &l).expect("symlink");
        assert!(no_follow().append(true).create(true).open(&l).is_err());
        assert_eq!(std::fs::read(&target).expect("read"), b"keep");
    }
}
