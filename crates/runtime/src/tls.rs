//! TLS 1.3 with mutual authentication between the two daemons, and certificate creation.
//!
//! Both sides present a certificate from the site CA. The connecting side checks the listener's name
//! through rustls; rustls checks the client's chain but not its name, so [`check_peer_name`] does
//! that on the listening side before a single frame is read. [`create_site_certs`] mints a CA and
//! per-site certificates with rcgen, so no openssl is needed; the daemon never mints on its own.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

use crate::config::TlsPaths;

/// A TLS setup problem; each names the file or the peer concerned.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error(
        "TLS file {path} is missing; create the site certificates with `wanoptd certs --out DIR SITE...`"
    )]
    Missing { path: PathBuf },
    #[error("TLS file {path}: {msg}")]
    Bad { path: PathBuf, msg: String },
    #[error("TLS setup: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("peer certificate: {0}")]
    PeerName(String),
    #[error("certificate creation: {0}")]
    Create(String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The loaded key material of one site.
#[derive(Debug, Clone)]
pub struct TlsMaterial {
    pub server: Arc<ServerConfig>,
    pub client: Arc<ClientConfig>,
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn need(path: &Path) -> Result<(), TlsError> {
    if path.exists() {
        Ok(())
    } else {
        Err(TlsError::Missing {
            path: path.to_path_buf(),
        })
    }
}

fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    need(path)?;
    let bad = |msg: String| TlsError::Bad {
        path: path.to_path_buf(),
        msg,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("no certificate in PEM file".into()));
    }
    Ok(certs)
}

fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    need(path)?;
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::Bad {
        path: path.to_path_buf(),
        msg: e.to_string(),
    })
}

/// Loads the CA, certificate and key named in the config and builds both TLS configs
/// (TLS 1.3 only, client certificates required).
pub fn load(paths: &TlsPaths) -> Result<TlsMaterial, TlsError> {
    let ca = load_certs(&paths.ca)?;
    let chain = load_certs(&paths.cert)?;
    let key = load_key(&paths.key)?;
    let mut roots = RootCertStore::empty();
    for c in ca {
        roots.add(c).map_err(|e| TlsError::Bad {
            path: paths.ca.clone(),
            msg: e.to_string(),
        })?;
    }
    let roots = Arc::new(roots);
    let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
        .build()
        .map_err(|e| TlsError::Bad {
            path: paths.ca.clone(),
            msg: e.to_string(),
        })?;
    let server = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain.clone(), key.clone_key())
        .map_err(|e| TlsError::Bad {
            path: paths.key.clone(),
            msg: format!("key does not fit the certificate: {e}"),
        })?;
    let client = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .map_err(|e| TlsError::Bad {
            path: paths.key.clone(),
            msg: format!("key does not fit the certificate: {e}"),
        })?;
    Ok(TlsMaterial {
        server: Arc::new(server),
        client: Arc::new(client),
    })
}

/// The name the connecting side expects in the listener's certificate.
pub fn server_name(peer: &str) -> Result<ServerName<'static>, TlsError> {
    ServerName::try_from(peer.to_string()).map_err(|e| TlsError::PeerName(format!("{peer:?}: {e}")))
}

/// Checks that the (already chain-verified) end-entity certificate is issued to `peer`.
pub fn check_peer_name(certs: Option<&[CertificateDer<'_>]>, peer: &str) -> Result<(), TlsError> {
    let cert = certs
        .and_then(|c| c.first())
        .ok_or_else(|| TlsError::PeerName("no client certificate".into()))?;
    let ee = webpki::EndEntityCert::try_from(cert)
        .map_err(|e| TlsError::PeerName(format!("unparsable certificate: {e}")))?;
    let name = server_name(peer)?;
    ee.verify_is_valid_for_subject_name(&name)
        .map_err(|_| TlsError::PeerName(format!("certificate is not issued to site {peer:?}")))
}

/// Writes `data` to `path` with the given mode, replacing any file there.
fn write_file(path: &Path, data: &[u8], mode: u32) -> Result<(), TlsError> {
    let io = |source| TlsError::Io {
        path: path.to_path_buf(),
        source,
    };
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(io)?;
    f.write_all(data).map_err(io)?;
    f.sync_all().map_err(io)
}

/// Creates (or reuses) a CA in `dir` and a key and certificate for each site name.
/// Files: `ca.pem`, `ca.key`, `SITE.pem`, `SITE.key`; keys are mode 0600. Returns the files written.
pub fn create_site_certs(dir: &Path, sites: &[String]) -> Result<Vec<PathBuf>, TlsError> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    };
    let cerr = |e: rcgen::Error| TlsError::Create(e.to_string());
    std::fs::create_dir_all(dir).map_err(|source| TlsError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut written = Vec::new();
    let ca_cert = dir.join("ca.pem");
    let ca_key_path = dir.join("ca.key");
    let issuer = if ca_key_path.exists() && ca_cert.exists() {
        let pem = std::fs::read_to_string(&ca_key_path).map_err(|source| TlsError::Io {
            path: ca_key_path.clone(),
            source,
        })?;
        let key = KeyPair::from_pem(&pem).map_err(cerr)?;
        let params = ca_params()?;
        Issuer::new(params, key)
    } else {
        let key = KeyPair::generate().map_err(cerr)?;
        let params = ca_params()?;
        let cert = params.self_signed(&key).map_err(cerr)?;
        write_file(&ca_key_path, key.serialize_pem().as_bytes(), 0o600)?;
        write_file(&ca_cert, cert.pem().as_bytes(), 0o644)?;
        written.push(ca_cert.clone());
        written.push(ca_key_path.clone());
        Issuer::new(params, key)
    };
    fn ca_params() -> Result<CertificateParams, TlsError> {
        let mut p = CertificateParams::new(Vec::<String>::new())
            .map_err(|e| TlsError::Create(e.to_string()))?;
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name
            .push(DnType::CommonName, "wanopt site CA");
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        p.not_before = rcgen::date_time_ymd(2024, 1, 1);
        p.not_after = rcgen::date_time_ymd(2036, 1, 1);
        Ok(p)
    }
    for site in sites {
        if !crate::config::valid_name(site) {
            return Err(TlsError::Create(format!(
                "{site:?} is not a valid site name (lowercase a-z, 0-9, -)"
            )));
        }
        let key = KeyPair::generate().map_err(cerr)?;
        let mut p = CertificateParams::new(vec![site.clone()]).map_err(cerr)?;
        p.distinguished_name.push(DnType::CommonName, site.as_str());
        p.use_authority_key_identifier_extension = true;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        p.not_before = rcgen::date_time_ymd(2024, 1, 1);
        p.not_after = rcgen::date_time_ymd(2031, 1, 1);
        let cert = p.signed_by(&key, &issuer).map_err(cerr)?;
        let kp = dir.join(format!("{site}.key"));
        let cp = dir.join(format!("{site}.pem"));
        write_file(&kp, key.serialize_pem().as_bytes(), 0o600)?;
        write_file(&cp, cert.pem().as_bytes(), 0o644)?;
        written.push(cp);
        written.push(kp);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn created_certs_load_and_names_are_checked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = create_site_certs(dir.path(), &["west".into(), "east".into()]).expect("certs");
        assert_eq!(files.len(), 6);
        let mode = std::fs::metadata(dir.path().join("west.key"))
            .expect("key")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let paths = TlsPaths {
            ca: dir.path().join("ca.pem"),
            cert: dir.path().join("west.pem"),
            key: dir.path().join("west.key"),
        };
        load(&paths).expect("loads");
        let east = load_certs(&dir.path().join("east.pem")).expect("east cert");
        check_peer_name(Some(&east), "east").expect("east is east");
        assert!(check_peer_name(Some(&east), "west").is_err());
        assert!(check_peer_name(None, "east").is_err());
        // A later call adds a site under the same CA.
        create_site_certs(dir.path(), &["north".into()]).expect("more");
        assert!(dir.path().join("north.pem").exists());
    }

    #[test]
    fn missing_and_garbage_files_are_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let paths = TlsPaths {
            ca: dir.path().join("ca.pem"),
            cert: dir.path().join("west.pem"),
            key: dir.path().join("west.key"),
        };
        let e = load(&paths).expect_err("missing");
        assert!(
            e.to_string().contains("ca.pem") && e.to_string().contains("wanoptd certs"),
            "{e}"
        );
        std::fs::write(&paths.ca, b"garbage").expect("write");
        let e = load(&paths).expect_err("garbage");
        assert!(e.to_string().contains("ca.pem"), "{e}");
    }
}
