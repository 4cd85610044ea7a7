"""CURVE key pairs for the served registry's principals, as ZeroMQ certificate files.

`weightpull keys new --role reader --name replica-0 --dir keys/` writes two files:
`replica-0.key`, the public certificate, and `replica-0.key_secret`, the secret one (mode
0600). Both carry the principal in their metadata (`role`, `name`). The server reads the
public certificates of its keys directory: each maps a client's public key to the
principal it authenticates as, and a key not there is refused at the handshake. The
`server` role names the server's own pair: its secret certificate is `serve --server-key`,
its public one what each client names as `--server-key` (or `$WEIGHTPULL_SERVER_KEY`).

Whoever can write the keys directory decides who is who: keep it the server's alone.
`revoke` moves a principal's certificates into `DIR/revoked/`; a running server stops
taking that key's requests at once.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import attrs
import zmq
import zmq.auth

from weightpull.errors import AuthenticationError, InvalidArgumentError
from weightpull.principals import Principal, Role, check_principal_name

log = logging.getLogger("weightpull.registry.keys")

KEY_ENV = "WEIGHTPULL_KEY"  # the client's secret certificate
SERVER_KEY_ENV = "WEIGHTPULL_SERVER_KEY"  # the server's public certificate
ROLES = ("publisher", "reader", "admin", "server")
PUBLIC_SUFFIX, SECRET_SUFFIX = ".key", ".key_secret"
REVOKED = "revoked"


@attrs.frozen
class Certificate:
    """One certificate file: its z85 public key, its secret key when it holds one, and
    the principal its metadata names (`role` is "server" for a server's pair)."""

    path: Path
    public: bytes
    secret: bytes | None
    role: str
    name: str

    @property
    def principal(self) -> Principal:
        if self.role == "server":
            raise AuthenticationError(f"{self.path} is a server's certificate, not a client's")
        return Principal(Role(self.role), self.name)


def _parse(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The `metadata` and `curve` sections of a ZeroMQ certificate (ZPL)."""
    sections: dict[str, dict[str, str]] = {"metadata": {}, "curve": {}}
    current: dict[str, str] | None = None
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.rstrip()
        if not line.strip() or line.lstrip().startswith("#"):  # z85 keys may hold '#': whole-line comments only
            continue
        if not line[0].isspace():
            current = sections.get(line.strip())
            continue
        if current is not None and "=" in line:
            key, value = line.split("=", 1)
            current[key.strip()] = value.strip().strip("'\"")
    return sections["metadata"], sections["curve"]


def load(path: str | os.PathLike[str]) -> Certificate:
    """A certificate file, checked: a 40-character z85 public key, a role and a valid name."""
    p = Path(path)
    try:
        metadata, curve = _parse(p)
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read the key file {str(p)!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise InvalidArgumentError(f"{str(p)!r} is not a ZeroMQ certificate (not text)") from None
    public, secret = curve.get("public-key", "").encode(), curve.get("secret-key", "").encode() or None
    if len(public) != 40 or (secret is not None and len(secret) != 40):
        raise InvalidArgumentError(f"{str(p)!r} is not a ZeroMQ CURVE certificate (no 40-character z85 keys)")
    role, name = metadata.get("role", ""), metadata.get("name", "")
    if role not in ROLES:
        raise InvalidArgumentError(
            f"{str(p)!r} names no weightpull role (metadata role = {role!r}): make keys with `weightpull keys new`"
        )
    try:
        check_principal_name(name)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{str(p)!r}: {exc}") from None
    return Certificate(p, public, secret, role, name)


def load_secret_cert(path: str | os.PathLike[str], what: str = "key") -> Certificate:
    cert = load(path)
    if cert.secret is None:
        raise InvalidArgumentError(
            f"{str(path)!r} holds no secret key: the {what} is the NAME{SECRET_SUFFIX} file `weightpull keys new` wrote"
        )
    return cert


def _write(path: Path, public: str, secret: str | None, metadata: Mapping[str, str]) -> None:
    kind = "Secret" if secret else "Public"
    lines = [
        f"#   ZeroMQ CURVE **{kind}** Certificate, made by `weightpull keys new`",
        "#   " + ("DO NOT PROVIDE THIS FILE TO OTHER USERS." if secret else "Give it to the registry server."),
        "",
        "metadata",
        *(f'    {k} = "{v}"' for k, v in metadata.items()),
        "curve",
        f'    public-key = "{public}"',
        *([f'    secret-key = "{secret}"'] if secret else []),
        "",
    ]
    path.write_text("\n".join(lines), encoding="utf-8")


def new(directory: str | os.PathLike[str], role: str, name: str) -> tuple[Path, Path]:
    """Make a key pair for `role NAME` in `directory`: (public, secret) certificate paths.
    Refuses to overwrite either file, and a name the directory already holds (or revoked)
    under any role."""
    if role not in ROLES:
        raise InvalidArgumentError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    check_principal_name(name)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for where in (out, out / REVOKED):
        for suffix in (PUBLIC_SUFFIX, SECRET_SUFFIX):
            existing = where / f"{name}{suffix}"
            if existing.exists():
                try:
                    held = f" as {load(existing).role} {name}"
                except InvalidArgumentError:
                    held = ""
                revoked = " (revoked)" if where != out else ""
                raise InvalidArgumentError(
                    f"{existing} exists{held}{revoked}: refusing to overwrite it; pick another name, or "
                    f"`weightpull keys revoke --name {name}` and remove it first"
                )
    metadata = {"role": role, "name": name}
    with tempfile.TemporaryDirectory(dir=out, prefix=".new-") as tmp:
        # zmq.auth writes the pair (metadata in the secret one only); the public one is
        # written again with the metadata, which the server reads the principal from.
        public_tmp, secret_tmp = (Path(p) for p in zmq.auth.create_certificates(tmp, name, metadata=metadata))
        os.chmod(secret_tmp, 0o600)
        cert = load(secret_tmp)
        assert cert.secret is not None
        _write(secret_tmp, cert.public.decode(), cert.secret.decode(), metadata)
        _write(public_tmp, cert.public.decode(), None, metadata)
        os.chmod(public_tmp, 0o644)
        public, secret = out / f"{name}{PUBLIC_SUFFIX}", out / f"{name}{SECRET_SUFFIX}"
        os.link(secret_tmp, secret)  # link: fails rather than overwrite a file made meanwhile
        try:
            os.link(public_tmp, public)
        except FileExistsError:
            secret.unlink()
            raise InvalidArgumentError(f"{public} appeared meanwhile: refusing to overwrite it") from None
    return public, secret


def listing(directory: str | os.PathLike[str]) -> list[tuple[Certificate, bool]]:
    """Every certificate in `directory` and its `revoked/`, each with whether it is revoked."""
    out: list[tuple[Certificate, bool]] = []
    for where, revoked in ((Path(directory), False), (Path(directory) / REVOKED, True)):
        if not where.is_dir():
            continue
        for path in sorted(where.glob(f"*{PUBLIC_SUFFIX}")):
            try:
                out.append((load(path), revoked))
            except InvalidArgumentError as exc:
                log.warning("skipped %s: %s", path, exc)
    return out


def revoke(directory: str | os.PathLike[str], name: str) -> list[Path]:
    """Move `name`'s certificates into `directory/revoked/`; the paths they moved to."""
    check_principal_name(name)
    base = Path(directory)
    found = [base / f"{name}{s}" for s in (PUBLIC_SUFFIX, SECRET_SUFFIX) if (base / f"{name}{s}").exists()]
    if not found:
        raise InvalidArgumentError(f"no key named {name!r} in {base} (`weightpull keys list --dir {base}` lists them)")
    (base / REVOKED).mkdir(exist_ok=True)
    moved = []
    for path in found:
        dest = base / REVOKED / path.name
        shutil.move(path, dest)  # the public certificate first: from now on the server refuses it
        moved.append(dest)
    return moved


def authorized(directory: str | os.PathLike[str]) -> dict[bytes, Principal]:
    """z85 public key -> principal, for every client certificate in `directory` (not its
    `revoked/`). A file that is no weightpull certificate, a server's, or a key named twice
    is left out, with a log line."""
    keys: dict[bytes, Principal] = {}
    twice: set[bytes] = set()
    base = Path(directory)
    for path in sorted(base.glob(f"*{PUBLIC_SUFFIX}")):
        try:
            cert = load(path)
        except InvalidArgumentError as exc:
            log.warning("keys: skipped %s", exc)
            continue
        if cert.role == "server":
            continue
        if cert.public in keys and keys[cert.public] != cert.principal:
            twice.add(cert.public)
        keys[cert.public] = cert.principal
    for public in twice:
        log.warning("keys: public key %s... is named by two principals in %s: refused", public[:8].decode(), base)
        del keys[public]
    return keys


def fingerprint(directory: str | os.PathLike[str]) -> tuple[tuple[str, int, int], ...]:
    """What changes when a certificate is added, removed, moved or rewritten."""
    out = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.name.endswith(PUBLIC_SUFFIX):
                    st = entry.stat()
                    out.append((entry.name, st.st_mtime_ns, st.st_size))
    except OSError:
        return ()
    return tuple(sorted(out))
