"""CURVE key pairs for the served registry's principals, as ZeroMQ certificate files.

`weightpull keys new --role reader --name replica-0 --dir keys/` writes two files:
`replica-0.key`, the public certificate, and `replica-0.key_secret`, the secret one (mode
0600). Both carry the principal in their metadata (`role`, `name`). The server reads the
public certificates of its keys directory: each maps a client's public key to the
principal it authenticates as, and a key not there is refused at the handshake. The
`server` role names the server's own pair: its secret certificate is `serve --server-key`,
its public one what each client names as `--server-key` (or `$WEIGHTPULL_SERVER_KEY`).

A reader's name may be a prefix, `--name 'rollout-*'`: one key shared by an autoscaled
group of replicas, each acting under a name of its own that extends the prefix
(`rollout-7`; principals.py). Its files are `rollout-+.key` and `rollout-+.key_secret` (no
'*' in a file name, which a shell would expand). No two keys of a directory may own a
name in common: `new` refuses a prefix that covers a name there (or one that a prefix
there covers), and a server leaves such a prefix out.

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
from weightpull.principals import WILDCARD, Principal, Role, check_principal_pattern, is_pattern, matches

log = logging.getLogger("weightpull.registry.keys")

KEY_ENV = "WEIGHTPULL_KEY"  # the client's secret certificate
SERVER_KEY_ENV = "WEIGHTPULL_SERVER_KEY"  # the server's public certificate
NAME_ENV = "WEIGHTPULL_NAME"  # the name a prefix key's client acts under (`rollout-7` of `rollout-*`)
ROLES = ("publisher", "reader", "admin", "server")
PUBLIC_SUFFIX, SECRET_SUFFIX = ".key", ".key_secret"
REVOKED = "revoked"
FILE_WILDCARD = "+"  # stands for a prefix's '*' in its file names


def file_stem(name: str) -> str:
    """The stem of a principal's certificate files: its name, a prefix's '*' as '+'."""
    return name[: -len(WILDCARD)] + FILE_WILDCARD if is_pattern(name) else name


def named(path: Path, source: str | None = None) -> str:
    """A key file as a message names it: its path, and where the path came from when it
    was not given directly (`$WEIGHTPULL_KEY`)."""
    return f"{str(path)!r}" + (f" (from {source})" if source else "")


def overlap(a: str, b: str) -> bool:
    """Whether two principals' names (or prefixes) own a name in common."""
    if is_pattern(a) and is_pattern(b):
        return a[:-1].startswith(b[:-1]) or b[:-1].startswith(a[:-1])
    if is_pattern(a):
        return matches(a, b)
    if is_pattern(b):
        return matches(b, a)
    return a == b


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


def load(path: str | os.PathLike[str], *, source: str | None = None) -> Certificate:
    """A certificate file, checked: a 40-character z85 public key, a role and a valid name
    (for a reader, perhaps a prefix). `source` says where the path came from
    (`"$WEIGHTPULL_KEY"`), for the messages."""
    p = Path(path)
    it = named(p, source)
    try:
        metadata, curve = _parse(p)
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read the key file {it}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise InvalidArgumentError(f"{it} is not a ZeroMQ certificate (not text)") from None
    public, secret = curve.get("public-key", "").encode(), curve.get("secret-key", "").encode() or None
    if len(public) != 40 or (secret is not None and len(secret) != 40):
        raise InvalidArgumentError(f"{it} is not a ZeroMQ CURVE certificate (no 40-character z85 keys)")
    role, name = metadata.get("role", ""), metadata.get("name", "")
    if role not in ROLES:
        raise InvalidArgumentError(
            f"{it} names no weightpull role (metadata role = {role!r}): make keys with `weightpull keys new`"
        )
    try:
        check_principal_pattern(name, role)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{it}: {exc}") from None
    return Certificate(p, public, secret, role, name)


def load_secret_cert(path: str | os.PathLike[str], what: str = "key", *, source: str | None = None) -> Certificate:
    """A certificate that holds a secret key (a client's `--key`, a server's own
    `--server-key`); `source` as for `load`."""
    cert = load(path, source=source)
    if cert.secret is None:
        raise InvalidArgumentError(
            f"{named(Path(path), source)} holds no secret key: the {what} is the "
            f"NAME{SECRET_SUFFIX} file `weightpull keys new` wrote"
            + (f" ({cert.path.with_name(cert.path.name + '_secret')} beside it)" if cert.path.suffix == ".key" else "")
        )
    return cert


def load_public_cert(
    path: str | os.PathLike[str], what: str = "server key", *, source: str | None = None
) -> Certificate:
    """A certificate given where only a public key belongs (a client's `--server-key`):
    refused if it holds a secret key, which must never leave its owner."""
    cert = load(path, source=source)
    if cert.secret is not None:
        public = cert.path.with_name(file_stem(cert.name) + PUBLIC_SUFFIX)
        raise InvalidArgumentError(
            f"{named(cert.path, source)} is the secret certificate of {cert.role} {cert.name}, but the {what} "
            f"is a public one: pass {public} (written beside it by `weightpull keys new`) instead, and keep the "
            "secret file with its owner alone"
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
    check_principal_pattern(name, role)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    stem = file_stem(name)
    for where in (out, out / REVOKED):
        for suffix in (PUBLIC_SUFFIX, SECRET_SUFFIX):
            existing = where / f"{stem}{suffix}"
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
    if role != "server":
        for cert, _ in listing(out, revoked=False):
            if cert.role != "server" and overlap(cert.name, name):
                raise InvalidArgumentError(
                    f"{name!r} and {cert.role} {cert.name} ({cert.path}) would own names in common (a prefix "
                    f"'P*' owns every name starting with P): pick a name neither covers, or revoke {cert.name}"
                )
    metadata = {"role": role, "name": name}
    with tempfile.TemporaryDirectory(dir=out, prefix=".new-") as tmp:
        # zmq.auth writes the pair (metadata in the secret one only); the public one is
        # written again with the metadata, which the server reads the principal from.
        public_tmp, secret_tmp = (Path(p) for p in zmq.auth.create_certificates(tmp, stem, metadata=metadata))
        os.chmod(secret_tmp, 0o600)
        cert = load(secret_tmp)
        assert cert.secret is not None
        _write(secret_tmp, cert.public.decode(), cert.secret.decode(), metadata)
        _write(public_tmp, cert.public.decode(), None, metadata)
        os.chmod(public_tmp, 0o644)
        public, secret = out / f"{stem}{PUBLIC_SUFFIX}", out / f"{stem}{SECRET_SUFFIX}"
        os.link(secret_tmp, secret)  # link: fails rather than overwrite a file made meanwhile
        try:
            os.link(public_tmp, public)
        except FileExistsError:
            secret.unlink()
            raise InvalidArgumentError(f"{public} appeared meanwhile: refusing to overwrite it") from None
    return public, secret


def listing(directory: str | os.PathLike[str], *, revoked: bool = True) -> list[tuple[Certificate, bool]]:
    """Every certificate in `directory` and (unless `revoked=False`) its `revoked/`, each
    with whether it is revoked."""
    out: list[tuple[Certificate, bool]] = []
    places = ((Path(directory), False), (Path(directory) / REVOKED, True))
    for where, gone in places if revoked else places[:1]:
        if not where.is_dir():
            continue
        for path in sorted(where.glob(f"*{PUBLIC_SUFFIX}")):
            try:
                out.append((load(path), gone))
            except InvalidArgumentError as exc:
                log.warning("skipped %s: %s", path, exc)
    return out


def revoke(directory: str | os.PathLike[str], name: str) -> list[Path]:
    """Move `name`'s certificates into `directory/revoked/`; the paths they moved to."""
    check_principal_pattern(name, Role.READER if is_pattern(name) else "")
    base, stem = Path(directory), file_stem(name)
    found = [base / f"{stem}{s}" for s in (PUBLIC_SUFFIX, SECRET_SUFFIX) if (base / f"{stem}{s}").exists()]
    if not found:
        raise InvalidArgumentError(f"no key named {name!r} in {base} (`weightpull keys list --dir {base}` lists them)")
    (base / REVOKED).mkdir(exist_ok=True)
    moved = []
    for path in found:
        dest = base / REVOKED / path.name
        shutil.move(path, dest)  # the public certificate first: from now on the server refuses it
        moved.append(dest)
    return moved


@attrs.frozen
class Refusal:
    """Why a key that a keys directory knows of is not admitted: what it is known as
    there (its file and principal) and the reason, for the server's log."""

    known_as: str
    why: str


def scan(directory: str | os.PathLike[str]) -> tuple[dict[bytes, Principal], dict[bytes, Refusal]]:
    """The keys of `directory`: z85 public key -> principal for every client certificate
    admitted, and -> `Refusal` for each one known but not admitted (revoked, the server's
    own, named by two principals, a prefix owning another key's names). A file that is
    no weightpull certificate is left out, with a log line."""
    base = Path(directory)
    keys: dict[bytes, Principal] = {}
    certs: dict[bytes, Certificate] = {}
    refused: dict[bytes, Refusal] = {}
    twice: set[bytes] = set()
    for path in sorted(base.glob(f"*{PUBLIC_SUFFIX}")):
        try:
            cert = load(path)
        except InvalidArgumentError as exc:
            log.warning("keys: skipped %s", exc)
            continue
        if cert.role == "server":
            refused[cert.public] = Refusal(f"{path}, server {cert.name}", "it is the server's own key, not a client's")
            continue
        if cert.public in keys and keys[cert.public] != cert.principal:
            twice.add(cert.public)
        keys[cert.public], certs[cert.public] = cert.principal, cert
    for public in twice:
        log.warning("keys: public key %s... is named by two principals in %s: refused", public[:8].decode(), base)
        refused[public] = Refusal(f"{certs[public].path}", f"two certificates in {base} name it, as two principals")
        del keys[public], certs[public]
    for public, cert in list(certs.items()):  # a prefix may own no other key's names
        if not is_pattern(cert.name):
            continue
        other = next((c for k, c in certs.items() if k != public and overlap(c.name, cert.name)), None)
        if other is not None:
            log.warning(
                "keys: %s (%s) owns names of %s (%s) too: refused", cert.principal, cert.path, other.name, other.path
            )
            refused[public] = Refusal(
                f"{cert.path}, {cert.principal}", f"its prefix owns names that {other.name} ({other.path}) owns too"
            )
            del keys[public]
    if (base / REVOKED).is_dir():
        for path in sorted((base / REVOKED).glob(f"*{PUBLIC_SUFFIX}")):
            try:
                cert = load(path)
            except InvalidArgumentError:
                continue
            if cert.public not in keys:
                who = f"server {cert.name}" if cert.role == "server" else str(cert.principal)
                refused[cert.public] = Refusal(f"{path}, {who}", f"revoked (its certificate is in {base / REVOKED})")
    return keys, refused


def authorized(directory: str | os.PathLike[str]) -> dict[bytes, Principal]:
    """z85 public key -> principal, for every client certificate in `directory` (not its
    `revoked/`). A file that is no weightpull certificate, a server's, a key named twice,
    or a prefix owning another key's names is left out, with a log line."""
    return scan(directory)[0]


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
