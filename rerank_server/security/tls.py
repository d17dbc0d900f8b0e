"""TLS certificate files (`--tls-cert`, `--tls-key`, `--tls-client-ca`), re-read on change."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError


@dataclass
class CertificateFiles:
    """The certificate, key and client CA files, and whether they changed since loaded.

    An edge asks `changed()` (file times, taken before it reads the files), loads them
    into a fresh context for new connections, and only then calls `loaded()` with those
    times: a file replaced during the read counts as changed again, and a pair caught
    half-written fails to load, keeps the old context, and is tried at the next check.
    """

    cert: Path
    key: Path
    client_ca: Path | None = None
    _seen: tuple[int, ...] = field(default=(), repr=False)  # times of the loaded files

    @classmethod
    def from_paths(cls, cert: str, key: str, client_ca: str = "") -> CertificateFiles | None:
        """The files, checked readable now; None when TLS is off (no certificate)."""
        if not cert:
            return None
        files = cls(
            Path(cert).expanduser(),
            Path(key).expanduser(),
            Path(client_ca).expanduser() if client_ca else None,
        )
        for name, path in (
            ("--tls-cert", files.cert),
            ("--tls-key", files.key),
            ("--tls-client-ca", files.client_ca),
        ):
            if path is not None and not path.is_file():
                raise ConfigError(f"{name}: {path} is not a readable file")
        files.loaded()  # the times the first load sees
        return files

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def read(self) -> tuple[bytes, bytes, bytes | None]:
        """(certificate chain, private key, client CA or None), as PEM bytes."""
        ca = self.client_ca.read_bytes() if self.client_ca is not None else None
        return self.cert.read_bytes(), self.key.read_bytes(), ca

    def _times(self) -> tuple[int, ...]:
        paths = [p for p in (self.cert, self.key, self.client_ca) if p is not None]
        try:
            return tuple(p.stat().st_mtime_ns for p in paths)
        except OSError:
            return self._seen  # being replaced: keep what works

    def changed(self) -> tuple[int, ...] | None:
        """The files' times when any changed since the last successful load, else None:
        read the files after this, and hand the times to `loaded()`."""
        times = self._times()
        return times if times != self._seen else None

    def loaded(self, times: tuple[int, ...] | None = None) -> None:
        """The files as they were at `times` (`changed()`'s; default: now) were loaded:
        stop reporting them as changed."""
        self._seen = self._times() if times is None else times

    def server_context(self) -> ssl.SSLContext:
        """A server-side context with these files (for the HTTP edge)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.load_into(context)
        if self.client_ca is not None:
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def load_into(self, context: ssl.SSLContext) -> None:
        """Load the files into `context` (a fresh one: a failed load spoils a context)."""
        context.load_cert_chain(self.cert, self.key)
        if self.client_ca is not None:
            context.load_verify_locations(cafile=self.client_ca)
