"""NCCL's reader of its configuration files, rule for rule: which settings NCCL takes from
/etc/nccl.conf and from the files and environment it ranks above it.

The rules follow NCCL v2.30.7-1 (commit 73cf1122) src/misc/param.cc ``setEnvFile`` and
``initEnvFunc``, and src/os/linux.cc ``ncclOsSetEnv`` (the same at v2.23.4-1):

- a file is read with ``fgets`` into a 4096-byte buffer: a record ends at a newline or after
  4095 bytes (the rest of a longer line is read as records of its own); ``strlen`` ends a record
  at a NUL byte; one trailing ``\\n`` and then one ``\\r`` are dropped;
- a record whose first byte is ``#`` is a comment, one without ``=`` is skipped;
- the key is everything before the first ``=``, the value everything after, each cut at 1023
  bytes; no trimming, no quotes removed, no ``export`` understood;
- every pair is applied with ``setenv(key, value, 0)``, which never overwrites: within one file
  the FIRST record of a key wins, and the process environment wins over ``$NCCL_CONF_FILE``
  (where set and not empty, else ``$HOME/.nccl.conf``), which wins over /etc/nccl.conf.

Standard library only (python3 >= 3.6): the in-guest verifier reads the guest's files with it,
and gpuvfio.guest.nccl_conf merges /etc/nccl.conf by it.
"""

FGETS_BYTES = 4095  # fgets(line, 4096, file) reads at most 4095 bytes and a NUL
FIELD_BYTES = 1023  # envVar and envValue are 1024-byte buffers
ETC_FILE = "/etc/nccl.conf"


def records(data):
    """(offset, key, value) of each record of ``data`` in the order setEnvFile reads them; key
    and value are None for a comment or a record without ``=``."""
    out = []
    offset = 0
    while offset < len(data):
        end = data.find(b"\n", offset, offset + FGETS_BYTES)
        end = offset + FGETS_BYTES if end < 0 else end + 1
        end = min(end, len(data))
        line = data[offset:end].split(b"\0", 1)[0]  # strlen stops at a NUL
        if line.endswith(b"\n"):
            line = line[:-1]
        if line.endswith(b"\r"):
            line = line[:-1]
        key = value = None
        if not line.startswith(b"#") and b"=" in line:
            name, _, rest = line.partition(b"=")
            key, value = name[:FIELD_BYTES], rest[:FIELD_BYTES]
        out.append((offset, key, value))
        offset = end
    return out


def pairs(data):
    """The (key, value) pairs one file sets, as setenv(..., 0) leaves them: the first of each key
    (an empty key is refused by setenv)."""
    seen = {}
    for _offset, key, value in records(data):
        if key and key not in seen:
            seen[key] = value
    return list(seen.items())


def user_file(environ):
    """The file initEnvFunc reads before /etc/nccl.conf: $NCCL_CONF_FILE where set and not
    empty, else "$HOME/.nccl.conf" (userHomeDir is getenv("HOME"); None: HOME is not set)."""
    named = environ.get("NCCL_CONF_FILE")
    if named:
        return named
    home = environ.get("HOME")
    return "%s/.nccl.conf" % home if home is not None else None
