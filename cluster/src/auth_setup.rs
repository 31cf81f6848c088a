//! Turning on etcd's authentication with Ferry's roles (`ferry cluster auth-setup`).
//!
//! etcd's RBAC grants a role read or read-write on key ranges; Ferry's keys (see
//! [`crate::model`]) are split by prefix, so each kind of program gets the
//! prefixes it writes:
//!
//! | user (role)    | writes                                  | reads       |
//! |----------------|-----------------------------------------|-------------|
//! | `ferry-node`   | `/ferry/nodes/`, `/ferry/members/`      | `/ferry/`   |
//! | `ferry-client` | `/ferry/ns/`, `/ferry/shared/`, `/ferry/locks/` | `/ferry/` |
//! | `ferry-admin`  | everything under `/ferry/` (`shares/`, `draining/`) | `/ferry/` |
//! | `root`         | everything (etcd's own `root` role)     | everything  |
//!
//! What prefix RBAC cannot say: a node's role covers every node's record, so one node
//! can overwrite or delete another's registration; a client's covers every share's
//! namespace. Ferry's own checks (objects verified against the layout's manifests,
//! nodes accepting `Replicate` only from live members) stand behind that.
//!
//! The setup is idempotent: roles and users that exist get their permissions and
//! passwords again, and enabling authentication that is on already is a no-op. Each
//! user's password is the first line of `DIR/USER.password`; a missing file gets a new
//! random password (written mode 0600, never replaced).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::model::locks::all_locks_prefix;
use crate::model::{members_prefix, nodes_prefix, ns_prefix, ROOT_PREFIX};
use etcd_client::Permission;

use super::meta::Meta;
use ferry_client::error::ClientError;

/// The node role and user.
pub const NODE_ROLE: &str = "ferry-node";
/// The client role and user.
pub const CLIENT_ROLE: &str = "ferry-client";
/// The administrator role and user.
pub const ADMIN_ROLE: &str = "ferry-admin";
/// etcd's superuser (and its built-in role).
pub const ROOT_USER: &str = "root";

/// The users the setup makes, each with its role (the same name).
pub const USERS: [&str; 4] = [ROOT_USER, ADMIN_ROLE, NODE_ROLE, CLIENT_ROLE];

/// The prefix of layouts named by more than one entry (see [`Meta::mark_shared`]).
fn shared_prefix() -> String {
    format!("{ROOT_PREFIX}shared/")
}

/// Each Ferry role and the prefixes it may write; every role reads all of
/// [`ROOT_PREFIX`].
pub fn role_writes() -> [(&'static str, Vec<String>); 3] {
    [
        (NODE_ROLE, vec![nodes_prefix(), members_prefix()]),
        (
            CLIENT_ROLE,
            vec![ns_prefix(), shared_prefix(), all_locks_prefix()],
        ),
        (ADMIN_ROLE, vec![ROOT_PREFIX.to_owned()]),
    ]
}

/// What the setup did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AuthSetup {
    /// Each user and the file holding its password.
    pub users: Vec<(String, PathBuf)>,
    /// The password files this run created (new random passwords).
    pub created: Vec<PathBuf>,
}

/// The password of `user` in `dir`: read from `dir/USER.password`, or made up and
/// written there (mode 0600) if the file does not exist. Returns whether it was made.
fn password(dir: &Path, user: &str) -> Result<(String, bool), ClientError> {
    let path = password_file(dir, user);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let pw = text.lines().next().unwrap_or_default().to_owned();
            if pw.is_empty() {
                return Err(ClientError::Usage(format!(
                    "{}: empty password file",
                    path.display()
                )));
            }
            Ok((pw, false))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let bytes: [u8; 24] = rand::random();
            let pw: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .map_err(|e| ClientError::local(&path, "creating a password file", e))?;
            writeln!(f, "{pw}")
                .and_then(|()| f.sync_all())
                .map_err(|e| ClientError::local(&path, "writing a password file", e))?;
            Ok((pw, true))
        }
        Err(e) => Err(ClientError::local(&path, "reading a password file", e)),
    }
}

/// The password file of `user` in `dir`.
pub fn password_file(dir: &Path, user: &str) -> PathBuf {
    dir.join(format!("{user}.password"))
}

/// Whether `e` says the role or user exists already.
fn exists(e: &etcd_client::Error) -> bool {
    e.to_string().contains("already exists")
}

/// Creates Ferry's roles and users in the etcd of `meta` (connected as `root`, or
/// anonymously while authentication is off), with passwords from `dir`, then turns
/// authentication on. See the module docs.
pub async fn auth_setup(meta: &Meta, dir: &Path) -> Result<AuthSetup, ClientError> {
    let mut etcd = meta.etcd();
    for (role, writes) in role_writes() {
        match etcd.role_add(role).await {
            Err(e) if !exists(&e) => return Err(meta.err(&format!("adding role {role}"), e)),
            _ => {}
        }
        let read = Permission::read(ROOT_PREFIX).with_prefix();
        let grants = writes
            .into_iter()
            .map(|p| Permission::read_write(p).with_prefix());
        for perm in std::iter::once(read).chain(grants) {
            etcd.role_grant_permission(role, perm)
                .await
                .map_err(|e| meta.err(&format!("granting role {role} its keys"), e))?;
        }
    }
    let mut report = AuthSetup {
        users: Vec::new(),
        created: Vec::new(),
    };
    for user in USERS {
        let (pw, made) = password(dir, user)?;
        let op = format!("adding user {user}");
        match etcd.user_add(user, pw.clone(), None).await {
            Err(e) if exists(&e) => {
                etcd.user_change_password(user, pw)
                    .await
                    .map_err(|e| meta.err(&format!("setting the password of {user}"), e))?;
            }
            Err(e) => return Err(meta.err(&op, e)),
            Ok(_) => {}
        }
        etcd.user_grant_role(user, user)
            .await
            .map_err(|e| meta.err(&format!("granting {user} its role"), e))?;
        let file = password_file(dir, user);
        if made {
            report.created.push(file.clone());
        }
        report.users.push((user.to_owned(), file));
    }
    etcd.auth_enable()
        .await
        .map_err(|e| meta.err("enabling authentication", e))?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_write_only_their_prefixes() {
        let roles = role_writes();
        assert_eq!(roles[0].1, ["/ferry/nodes/", "/ferry/members/"]);
        assert_eq!(
            roles[1].1,
            ["/ferry/ns/", "/ferry/shared/", "/ferry/locks/"]
        );
        assert_eq!(roles[2].1, ["/ferry/"]);
    }

    #[test]
    fn password_files_are_made_once_and_private() {
        let dir = tempfile::tempdir().unwrap();
        let (a, made) = password(dir.path(), "u").unwrap();
        assert!(made);
        assert_eq!(a.len(), 48);
        let (b, made) = password(dir.path(), "u").unwrap();
        assert!(!made);
        assert_eq!(a, b);
        let mode = std::fs::metadata(password_file(dir.path(), "u"))
            .unwrap()
            .permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o600
        );
    }
}
