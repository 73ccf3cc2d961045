"""Binding devices to vfio-pci: the plan (checks, steps), applying it with rollback, sysfs writes
with timeouts, the journal and lock, persistence across reboots."""
