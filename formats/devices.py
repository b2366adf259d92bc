"""What a device offers a model: whether torch can use it, and its free memory, against which the
weights are refused before anything is allocated (models.from_config) and the engine's KV cache
before it is (engine/memory.py)."""
import torch


def free_memory(device):
    """Bytes a new allocation on `device` can take: on CUDA the device's free memory plus what
    torch's caching allocator holds unused; on a CPU MemAvailable (None where /proc/meminfo
    is missing)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f
                        if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def check_device(device):
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: this torch ({torch.__version__}) has no CUDA or "
                         "sees no GPU; use the CPU")


def check_weights_fit(model, device, dtype):
    """Refuse, before anything is allocated, weights (of a model on the meta device) that do
    not fit."""
    need = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    free = free_memory(device)
    if free is not None and need > free:
        raise ValueError(f"the weights need {need / 2**30:.2f} GiB in "
                         f"{str(dtype).replace('torch.', '')}, but {device} has {free / 2**30:.2f} "
                         "GiB free: try a smaller dtype (--dtype bfloat16 halves float32), or a "
                         "device with more memory")
