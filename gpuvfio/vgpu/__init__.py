"""vGPU: the types a GPU offers, instances (legacy mdev, SR-IOV VF types), the NVML scheduler
policy; journaled."""
