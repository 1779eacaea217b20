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

use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer, ServerName};
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
    #[error("TLS key file {msg}")]
    Exposed { msg: String },
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
    /// Expiry (Unix seconds) of this site's certificate and of the CA, for the metrics.
    pub cert_expiry: Option<u64>,
    pub ca_expiry: Option<u64>,
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
    load_pem(path, "certificate")
}

/// The revocation lists in a PEM file (`wanoptd certs --revoke` writes `crl.pem`).
fn load_crls(path: &Path) -> Result<Vec<CertificateRevocationListDer<'static>>, TlsError> {
    load_pem(path, "revocation list (X509 CRL)")
}

/// Every PEM section of one kind in a file, at least one (`what` names the kind when none is).
fn load_pem<T: PemObject>(path: &Path, what: &str) -> Result<Vec<T>, TlsError> {
    need(path)?;
    let bad = |msg: String| TlsError::Bad {
        path: path.to_path_buf(),
        msg,
    };
    let items = T::pem_file_iter(path)
        .map_err(|e| bad(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    if items.is_empty() {
        return Err(bad(format!("no {what} in PEM file")));
    }
    Ok(items)
}

fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    need(path)?;
    crate::secure::private_key_file(path).map_err(|msg| TlsError::Exposed { msg })?;
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
    let ca_expiry = ca.first().and_then(|c| not_after(c));
    let cert_expiry = chain.first().and_then(|c| not_after(c));
    let key = load_key(&paths.key)?;
    let crls = match &paths.crl {
        Some(p) => load_crls(p)?,
        None => Vec::new(),
    };
    check_own(&ca, &chain, &crls, paths)?;
    let mut roots = RootCertStore::empty();
    for c in ca {
        roots.add(c).map_err(|e| TlsError::Bad {
            path: paths.ca.clone(),
            msg: e.to_string(),
        })?;
    }
    let roots = Arc::new(roots);
    let crl_error = |e: &dyn std::fmt::Display| TlsError::Bad {
        path: paths.crl.clone().unwrap_or_else(|| paths.ca.clone()),
        msg: e.to_string(),
    };
    let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
        .with_crls(crls.clone())
        .build()
        .map_err(|e| crl_error(&e))?;
    let server_verifier = WebPkiServerVerifier::builder_with_provider(roots.clone(), provider())
        .with_crls(crls)
        .build()
        .map_err(|e| crl_error(&e))?;
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
        .with_webpki_verifier(server_verifier)
        .with_client_auth_cert(chain, key)
        .map_err(|e| TlsError::Bad {
            path: paths.key.clone(),
            msg: format!("key does not fit the certificate: {e}"),
        })?;
    Ok(TlsMaterial {
        server: Arc::new(server),
        client: Arc::new(client),
        cert_expiry,
        ca_expiry,
    })
}

/// Refuses, before anything is bound, a certificate the peer would refuse at every handshake:
/// one issued to another site than the config's `site`, one the configured CA did not sign, or
/// one outside its validity (expired, or not yet valid by this host's clock).
fn check_own(
    ca: &[CertificateDer<'static>],
    chain: &[CertificateDer<'static>],
    crls: &[CertificateRevocationListDer<'static>],
    paths: &TlsPaths,
) -> Result<(), TlsError> {
    let bad = |path: &Path, msg: String| TlsError::Bad {
        path: path.to_path_buf(),
        msg,
    };
    let (own, intermediates) = chain
        .split_first()
        .ok_or_else(|| bad(&paths.cert, "no certificate in PEM file".into()))?;
    let ee = webpki::EndEntityCert::try_from(own)
        .map_err(|e| bad(&paths.cert, format!("unparsable certificate: {e}")))?;
    let site = &paths.site;
    let name = server_name(site)?;
    ee.verify_is_valid_for_subject_name(&name).map_err(|_| {
        bad(
            &paths.cert,
            format!(
                "the certificate is not issued to this site {site:?} (the config's `site`); \
                 the peer would refuse it: `wanoptd certs --out DIR {site}`"
            ),
        )
    })?;
    let anchors = ca
        .iter()
        .map(|c| {
            webpki::anchor_from_trusted_cert(c)
                .map(|a| a.to_owned())
                .map_err(|e| bad(&paths.ca, format!("not a CA certificate: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let parsed = crls
        .iter()
        .map(|c| {
            webpki::BorrowedCertRevocationList::from_der(c)
                .map(webpki::CertRevocationList::from)
                .map_err(|e| {
                    let path = paths.crl.as_deref().unwrap_or(&paths.ca);
                    bad(path, format!("unparsable revocation list: {e}"))
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let refs: Vec<&webpki::CertRevocationList<'_>> = parsed.iter().collect();
    let revocation = webpki::RevocationOptionsBuilder::new(&refs)
        .ok()
        .map(|b| b.build());
    let now = rustls::pki_types::UnixTime::now();
    for usage in [
        webpki::KeyUsage::server_auth(),
        webpki::KeyUsage::client_auth(),
    ] {
        ee.verify_for_usage(
            webpki::ALL_VERIFICATION_ALGS,
            &anchors,
            intermediates,
            now,
            usage,
            revocation,
            None,
        )
        .map_err(|e| {
            let why = match e {
                webpki::Error::CertExpired { .. } => "the certificate has expired; renew it".to_string(),
                webpki::Error::CertRevoked => {
                    "the certificate is revoked (tls.crl); make this site a new one: `wanoptd certs --renew`".to_string()
                }
                webpki::Error::CertNotValidYet { .. } => {
                    "the certificate is not valid yet (check this host's clock)".to_string()
                }
                webpki::Error::UnknownIssuer | webpki::Error::InvalidSignatureForPublicKey => format!(
                    "the certificate is not signed by the configured CA {}; the peer would refuse it",
                    paths.ca.display()
                ),
                other => format!("the certificate does not verify against the configured CA: {other}"),
            };
            bad(&paths.cert, why)
        })?;
    }
    Ok(())
}

/// One DER element: (tag, contents, rest). Lengths are checked against the input.
fn der(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |a, b| (a << 8) | usize::from(*b));
        (len, &rest[n..])
    };
    if rest.len() < len {
        return None;
    }
    Some((tag, &rest[..len], &rest[len..]))
}

/// Days from 1970-01-01 to a civil date (proleptic Gregorian).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The `notAfter` of a certificate, in Unix seconds; `None` if the DER is not what X.509 says.
pub fn not_after(cert: &[u8]) -> Option<u64> {
    let (0x30, certificate, _) = der(cert)? else {
        return None;
    };
    let (0x30, tbs, _) = der(certificate)? else {
        return None;
    };
    let mut rest = tbs;
    let (tag, _, r) = der(rest)?;
    if tag == 0xa0 {
        rest = r; // explicit version
    }
    for _ in 0..3 {
        // serialNumber, signature, issuer
        rest = der(rest)?.2;
    }
    let (0x30, validity, _) = der(rest)? else {
        return None;
    };
    let (_, _, r) = der(validity)?;
    let (tag, t, _) = der(r)?;
    let t = std::str::from_utf8(t).ok()?;
    let digits = t.strip_suffix('Z')?;
    let (year, rest) = match tag {
        0x17 => {
            let yy: i64 = digits.get(..2)?.parse().ok()?;
            (
                if yy >= 50 { 1900 + yy } else { 2000 + yy },
                digits.get(2..)?,
            )
        }
        0x18 => (digits.get(..4)?.parse().ok()?, digits.get(4..)?),
        _ => return None,
    };
    let field = |i: usize| -> Option<i64> { rest.get(i..i + 2)?.parse().ok() };
    let (mo, d, h, mi, s) = (field(0)?, field(2)?, field(4)?, field(6)?, field(8)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || s > 60 {
        return None;
    }
    let secs = days_from_civil(year, mo, d) * 86_400 + h * 3600 + mi * 60 + s;
    u64::try_from(secs).ok()
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

/// How long site certificates last unless `wanoptd certs --days` says otherwise.
pub const SITE_DAYS: u32 = 825;
/// How long a new site CA lasts.
pub const CA_DAYS: u32 = 3650;

/// How `wanoptd certs` mints.
#[derive(Debug, Clone, Copy)]
pub struct Minting {
    /// Site certificates are valid from an hour ago (clocks differ) for this many days.
    pub days: u32,
    /// Only under the CA already in the folder (renewing must never start a new trust).
    pub renew: bool,
}

impl Default for Minting {
    fn default() -> Self {
        Minting {
            days: SITE_DAYS,
            renew: false,
        }
    }
}

/// Creates (or reuses) a CA in `dir` and a key and certificate for each site name.
/// Files: `ca.pem`, `ca.key`, `SITE.pem`, `SITE.key`; keys are mode 0600. Returns the files written.
pub fn create_site_certs(
    dir: &Path,
    sites: &[String],
    minting: &Minting,
) -> Result<Vec<PathBuf>, TlsError> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    };
    let cerr = |e: rcgen::Error| TlsError::Create(e.to_string());
    if minting.days == 0 || minting.days > CA_DAYS {
        return Err(TlsError::Create(format!(
            "--days {}: a site certificate lasts 1 to {CA_DAYS} days",
            minting.days
        )));
    }
    std::fs::create_dir_all(dir).map_err(|source| TlsError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    // Validity from now (an hour back, for a peer whose clock is a little behind).
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| TlsError::Create(format!("this host's clock: {e}")))?;
    let now = rcgen::date_time_ymd(1970, 1, 1) + since_epoch;
    let hour = std::time::Duration::from_secs(3600);
    let days = |n: u32| std::time::Duration::from_secs(u64::from(n) * 86_400);
    let mut written = Vec::new();
    let ca_cert = dir.join("ca.pem");
    let ca_key_path = dir.join("ca.key");
    let ca_params = || -> Result<CertificateParams, TlsError> {
        let mut p = CertificateParams::new(Vec::<String>::new())
            .map_err(|e| TlsError::Create(e.to_string()))?;
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name
            .push(DnType::CommonName, "wanopt site CA");
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        p.not_before = now - hour;
        p.not_after = now + days(CA_DAYS);
        Ok(p)
    };
    let issuer = if ca_key_path.exists() && ca_cert.exists() {
        let pem = std::fs::read_to_string(&ca_key_path).map_err(|source| TlsError::Io {
            path: ca_key_path.clone(),
            source,
        })?;
        let key = KeyPair::from_pem(&pem).map_err(cerr)?;
        Issuer::new(ca_params()?, key)
    } else if minting.renew {
        return Err(TlsError::Create(format!(
            "--renew: no CA in {} (ca.pem and ca.key); renewing never starts a new CA, which \
             every site would have to trust anew",
            dir.display()
        )));
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
        // A serial of its own, so a revocation names this certificate and no other.
        let mut serial = rand::random::<[u8; 16]>();
        serial[0] &= 0x7f;
        p.serial_number = Some(rcgen::SerialNumber::from_slice(&serial));
        p.not_before = now - hour;
        p.not_after = now + days(minting.days);
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

/// The serial number of a certificate (its DER bytes), `None` if the DER is not X.509's.
pub fn serial_of(cert: &[u8]) -> Option<Vec<u8>> {
    let (0x30, certificate, _) = der(cert)? else {
        return None;
    };
    let (0x30, tbs, _) = der(certificate)? else {
        return None;
    };
    let (tag, body, rest) = der(tbs)?;
    let (tag, body) = if tag == 0xa0 {
        let (t, b, _) = der(rest)?;
        (t, b)
    } else {
        (tag, body)
    };
    (tag == 0x02).then(|| body.to_vec())
}

/// Revokes the current certificate of each site in `dir` under its CA: adds it to `revoked`
/// (one line per certificate: serial in hex, site, Unix time) and writes `crl.pem`, the CA's
/// signed list of every certificate revoked so far, for `tls.crl` on every site. Returns
/// `crl.pem`'s path.
pub fn revoke_site_certs(dir: &Path, sites: &[String]) -> Result<PathBuf, TlsError> {
    use rcgen::{
        CertificateParams, CertificateRevocationListParams, Issuer, KeyIdMethod, KeyPair,
        RevokedCertParams, SerialNumber,
    };
    let cerr = |e: rcgen::Error| TlsError::Create(e.to_string());
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| TlsError::Io { path, source }
    };
    let ca_cert = dir.join("ca.pem");
    let ca_key_path = dir.join("ca.key");
    if !ca_cert.exists() || !ca_key_path.exists() {
        return Err(TlsError::Create(format!(
            "--revoke: no CA in {} (ca.pem and ca.key)",
            dir.display()
        )));
    }
    let list_path = dir.join("revoked");
    let mut list = match std::fs::read_to_string(&list_path) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(io(&list_path)(e)),
    };
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| TlsError::Create(format!("this host's clock: {e}")))?;
    for site in sites {
        let path = dir.join(format!("{site}.pem"));
        let certs = load_certs(&path)?;
        let serial = certs
            .first()
            .and_then(|c| serial_of(c))
            .ok_or_else(|| TlsError::Bad {
                path: path.clone(),
                msg: "no serial number in the certificate".into(),
            })?;
        let hex: String = serial.iter().map(|b| format!("{b:02x}")).collect();
        if !list
            .lines()
            .any(|l| l.split_whitespace().next() == Some(hex.as_str()))
        {
            list.push_str(&format!("{hex} {site} {}\n", since_epoch.as_secs()));
        }
    }
    let epoch = rcgen::date_time_ymd(1970, 1, 1);
    let now = epoch + since_epoch;
    let mut revoked = Vec::new();
    for line in list.lines() {
        let mut f = line.split_whitespace();
        let (Some(hex), _, Some(when)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let bytes: Option<Vec<u8>> = (0..hex.len())
            .step_by(2)
            .map(|i| {
                hex.get(i..i + 2)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
            })
            .collect();
        let (Some(bytes), Ok(when)) = (bytes, when.parse::<u64>()) else {
            return Err(TlsError::Bad {
                path: list_path.clone(),
                msg: format!("not a revocation line: {line:?}"),
            });
        };
        revoked.push(RevokedCertParams {
            serial_number: SerialNumber::from_slice(&bytes),
            revocation_time: epoch + std::time::Duration::from_secs(when),
            reason_code: None,
            invalidity_date: None,
        });
    }
    let pem = std::fs::read_to_string(&ca_key_path).map_err(io(&ca_key_path))?;
    let key = KeyPair::from_pem(&pem).map_err(cerr)?;
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(cerr)?;
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "wanopt site CA");
    ca.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
    ];
    let issuer = Issuer::new(ca, key);
    let crl = CertificateRevocationListParams {
        this_update: now - std::time::Duration::from_secs(3600),
        next_update: now + std::time::Duration::from_secs(u64::from(CA_DAYS) * 86_400),
        crl_number: SerialNumber::from(since_epoch.as_secs()),
        issuing_distribution_point: None,
        revoked_certs: revoked,
        key_identifier_method: KeyIdMethod::Sha256,
    }
    .signed_by(&issuer)
    .map_err(cerr)?;
    write_file(&list_path, list.as_bytes(), 0o644)?;
    let crl_path = dir.join("crl.pem");
    write_file(&crl_path, crl.pem().map_err(cerr)?.as_bytes(), 0o644)?;
    Ok(crl_path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn created_certs_load_and_names_are_checked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = create_site_certs(
            dir.path(),
            &["west".into(), "east".into()],
            &Default::default(),
        )
        .expect("certs");
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
            crl: None,
            site: "west".into(),
        };
        load(&paths).expect("loads");
        let east = load_certs(&dir.path().join("east.pem")).expect("east cert");
        check_peer_name(Some(&east), "east").expect("east is east");
        assert!(check_peer_name(Some(&east), "west").is_err());
        assert!(check_peer_name(None, "east").is_err());
        // Valid from now: the lifetimes are readable for the expiry metric, SITE_DAYS and
        // CA_DAYS from now.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs();
        let near = |t: Option<u64>, days: u32| {
            t.is_some_and(|t| t.abs_diff(now + u64::from(days) * 86_400) < 120)
        };
        assert!(
            near(not_after(&east[0]), SITE_DAYS),
            "{:?}",
            not_after(&east[0])
        );
        let ca = load_certs(&dir.path().join("ca.pem")).expect("ca");
        assert!(near(not_after(&ca[0]), CA_DAYS));
        assert_eq!(not_after(b"\x30\x03\x30\x01"), None);
        assert_eq!(not_after(&east[0][..40]), None);
        // A later call adds a site under the same CA.
        create_site_certs(dir.path(), &["north".into()], &Default::default()).expect("more");
        assert!(dir.path().join("north.pem").exists());
    }

    #[test]
    fn a_certificate_the_peer_would_refuse_is_refused_at_load() {
        let dir = tempfile::tempdir().expect("tempdir");
        let other = tempfile::tempdir().expect("tempdir");
        create_site_certs(
            dir.path(),
            &["west".into(), "east".into()],
            &Default::default(),
        )
        .expect("certs");
        create_site_certs(other.path(), &["west".into()], &Default::default()).expect("other CA");
        let paths = |ca: &Path, cert: &Path, key: &Path, site: &str| TlsPaths {
            ca: ca.join("ca.pem"),
            cert: cert.join(format!("{site}.pem")),
            key: key.join(format!("{site}.key")),
            crl: None,
            site: site.into(),
        };
        let d = dir.path();
        load(&paths(d, d, d, "west")).expect("west's own files load");
        // East's certificate and key in west's config.
        let mut p = paths(d, d, d, "east");
        p.site = "west".into();
        let e = load(&p)
            .expect_err("east's certificate for west")
            .to_string();
        assert!(
            e.contains("east.pem") && e.contains("not issued to this site \"west\""),
            "{e}"
        );
        // A certificate from another CA.
        let e = load(&paths(d, other.path(), other.path(), "west"))
            .expect_err("another CA")
            .to_string();
        assert!(e.contains("not signed by the configured CA"), "{e}");
        // West's certificate with east's key.
        let mut p = paths(d, d, d, "west");
        p.key = d.join("east.key");
        let e = load(&p)
            .expect_err("a key of another certificate")
            .to_string();
        assert!(e.contains("east.key") && e.contains("does not fit"), "{e}");
    }

    /// `--days` sets the period; `--renew` mints under the CA that is there and never makes
    /// one; `--revoke` lists a site's certificate in `crl.pem`, and a config that names it
    /// refuses that certificate (its own, at load; the peer's, at the handshake).
    #[test]
    fn certificates_are_renewed_and_revoked_under_one_ca() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        let empty = tempfile::tempdir().expect("tempdir");
        let renew = Minting {
            days: 30,
            renew: true,
        };
        let e = create_site_certs(empty.path(), &["west".into()], &renew)
            .expect_err("no CA to renew under")
            .to_string();
        assert!(e.contains("no CA"), "{e}");
        assert!(!empty.path().join("ca.pem").exists());
        create_site_certs(d, &["west".into(), "east".into()], &Minting::default()).expect("certs");
        let ca = std::fs::read(d.join("ca.pem")).expect("ca");
        let old_west = load_certs(&d.join("west.pem")).expect("west")[0].to_vec();
        create_site_certs(d, &["west".into()], &renew).expect("renew");
        assert_eq!(
            std::fs::read(d.join("ca.pem")).expect("ca"),
            ca,
            "the CA stays"
        );
        let west = load_certs(&d.join("west.pem")).expect("west")[0].to_vec();
        assert_ne!(serial_of(&west), serial_of(&old_west), "a new serial");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs();
        let left = not_after(&west).expect("expiry") - now;
        assert!(left.abs_diff(30 * 86_400) < 120, "{left} s left");
        assert!(
            create_site_certs(
                d,
                &["west".into()],
                &Minting {
                    days: 0,
                    renew: true
                }
            )
            .is_err()
        );
        // Revoke east: the list names it, and east's own config refuses to load.
        let crl = revoke_site_certs(d, &["east".into()]).expect("revoke");
        revoke_site_certs(d, &["east".into()]).expect("revoking again changes nothing");
        let listed = std::fs::read_to_string(d.join("revoked")).expect("list");
        assert_eq!(listed.lines().count(), 1, "{listed}");
        let paths = |site: &str| TlsPaths {
            ca: d.join("ca.pem"),
            cert: d.join(format!("{site}.pem")),
            key: d.join(format!("{site}.key")),
            crl: Some(crl.clone()),
            site: site.into(),
        };
        let e = load(&paths("east"))
            .expect_err("east is revoked")
            .to_string();
        assert!(e.contains("revoked"), "{e}");
        load(&paths("west")).expect("west is not");
        // A garbage list is named.
        std::fs::write(d.join("bad.pem"), b"not a crl").expect("write");
        let mut p = paths("west");
        p.crl = Some(d.join("bad.pem"));
        assert!(
            load(&p)
                .expect_err("garbage")
                .to_string()
                .contains("bad.pem")
        );
        assert!(revoke_site_certs(empty.path(), &["west".into()]).is_err());
    }

    #[test]
    fn expiry_parser_survives_any_damage() {
        let dir = tempfile::tempdir().expect("tempdir");
        create_site_certs(dir.path(), &["west".into()], &Default::default()).expect("certs");
        let cert = load_certs(&dir.path().join("west.pem")).expect("cert")[0].to_vec();
        // Every truncation and every single-byte corruption: an answer or None, never a panic.
        for cut in 0..cert.len() {
            let _ = not_after(&cert[..cut]);
        }
        for i in 0..cert.len() {
            for v in [0x00, 0x7f, 0x80, 0x84, 0xff] {
                let mut c = cert.clone();
                c[i] = v;
                let _ = not_after(&c);
            }
        }
    }

    #[test]
    fn missing_and_garbage_files_are_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let paths = TlsPaths {
            ca: dir.path().join("ca.pem"),
            cert: dir.path().join("west.pem"),
            key: dir.path().join("west.key"),
            crl: None,
            site: "west".into(),
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
