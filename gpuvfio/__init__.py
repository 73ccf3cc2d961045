"""gpuvfio: GPU passthrough provisioning for KVM hosts."""

__version__ = "0.1.0"
