"""libvirt: one connection helper and its errors, idempotent define, guest lifecycle, which domains
use a device."""
