"""The read-only view of a host through one root: paths and their confinement, PCI inventory, IOMMU
groups and what may be passed through, NUMA, kernel and NVIDIA facts, pci.ids names, fixtures,
doctor. Changes nothing."""
