"""Environment reads on the hot path of a call.

Several settings are environment variables read on every call (the numerics mode, the preferred
backend, the sm90 backend's routing switches), so that setting one takes effect at once.
``os.environ.get`` costs about 2 us (it encodes the key and decodes the value through Python code);
a module forward read five of them. ``getenv`` looks the encoded key up in ``os.environ``'s own
mapping, the one ``os.environ[...] = ...``, ``os.putenv``-free updates and ``del`` all write, and
decodes only a value that is set: the same answer for a fraction of the cost. Where that mapping is
missing (another Python), ``os.environ`` has been replaced by another object, or torch.compile is
tracing the call (dynamo knows ``os.environ.get``, not this mapping), it is ``os.environ.get``.
"""

from __future__ import annotations

import os

from torch.compiler import is_compiling

_ENVIRON = os.environ
_DATA = getattr(_ENVIRON, "_data", None)
_ENCODE = getattr(_ENVIRON, "encodekey", None)
_DECODE = getattr(_ENVIRON, "decodevalue", None)
_KEYS: dict[str, object] = {}


def getenv(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``."""
    if _DATA is None or _ENCODE is None or _DECODE is None or os.environ is not _ENVIRON or is_compiling():
        return os.environ.get(name, default)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = _ENCODE(name)
    value = _DATA.get(key)
    return default if value is None else _DECODE(value)


_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")
_DEFAULT = ("", "auto")


def switch(name: str) -> bool | None:
    """An on/off setting, read with ``getenv``: True for 1/true/yes/on, False for 0/false/no/off (any case, spaces
    around ignored), None where it is unset, empty or "auto" (the caller's default). Any other value is a
    ``ValueError`` naming the setting: a typo must not leave a switch at its default unseen."""
    value = getenv(name)
    if value is None:
        return None
    v = value.strip().lower()
    if v in _ON:
        return True
    if v in _OFF:
        return False
    if v in _DEFAULT:
        return None
    raise ValueError(f"{name}={value!r}: expected 1/true/yes/on, 0/false/no/off, or auto (the same as unset)")
