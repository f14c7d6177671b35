"""Throw-away PKI for the local control plane, made with the `openssl` CLI (Debian ships it).

One CA signs the API server's serving certificate and the client certificates. Identities follow
kubeadm: the admin is in group `system:masters`; controller-manager and scheduler use their
well-known user names so the bootstrap RBAC roles apply to them.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

# (file stem, subject CN, subject O or None)
CLIENTS = (
    ("admin", "fewerbits-admin", "system:masters"),
    ("controller-manager", "system:kube-controller-manager", None),
    ("scheduler", "system:kube-scheduler", None),
)


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {proc.stderr.strip()}")


def _key(path: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", path.name, cwd=path.parent)


def _signed(d: Path, stem: str, subject: str, ext: str) -> None:
    _key(d / f"{stem}.key")
    (d / f"{stem}.ext").write_text(ext)
    _openssl("req", "-new", "-key", f"{stem}.key", "-subj", subject, "-out", f"{stem}.csr", cwd=d)
    _openssl(
        "x509", "-req", "-in", f"{stem}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "30", "-sha256", "-extfile", f"{stem}.ext", "-out", f"{stem}.crt", cwd=d,
    )


def serving_cert(d: Path, stem: str, sans: str) -> tuple[Path, Path]:
    """A serving certificate signed by the CA in ``d`` (made by ``generate``) for ``sans``
    (``IP:127.0.0.1,DNS:...``), e.g. for an add-on's webhook server: (cert, key)."""
    if not (d / f"{stem}.crt").exists():
        _signed(d, stem, f"/CN={stem}",
                f"keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\nsubjectAltName={sans}\n")
    return d / f"{stem}.crt", d / f"{stem}.key"


def generate(d: Path, service_ip: str = "10.96.0.1") -> Path:
    """Write ca, apiserver serving, client certs and the service-account key pair into d."""
    d.mkdir(parents=True, exist_ok=True)
    if (d / "done").exists():
        return d
    _key(d / "ca.key")
    _openssl(
        "req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=fewerbits-e2e-ca", "-days", "30",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        "-out", "ca.crt", cwd=d,
    )
    sans = ",".join([
        "IP:127.0.0.1", f"IP:{service_ip}", "DNS:localhost", "DNS:kubernetes", "DNS:kubernetes.default",
        "DNS:kubernetes.default.svc", "DNS:kubernetes.default.svc.cluster.local",
    ])
    _signed(d, "apiserver", "/CN=kube-apiserver",
            f"keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\nsubjectAltName={sans}\n")
    for stem, cn, org in CLIENTS:
        subject = f"/CN={cn}" + (f"/O={org}" if org else "")
        _signed(d, stem, subject, "keyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n")
    # Service-account tokens: the API server verifies with sa.pub, signs with sa.key (as does
    # the controller-manager's token controller).
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "sa.key", cwd=d)
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
    (d / "done").write_text("ok\n")
    return d
