"""A static, preallocated KV cache: one ``[B, S_max, Hk, D]`` buffer pair per layer.

- Allocated once for the longest sequence a run may reach, so decode steps never
  allocate and the attention kernel reads a strided view ``k[:, :length]``.
- ``length`` is one Python int shared by every row of the batch (rows advance in
  lock step); it is host state on purpose, so slicing needs no device sync.
- Rolling back after a rejected draft is ``truncate(n)``: only the length moves; the
  stale entries beyond it are overwritten by the next ``append``.
- After a tree verify (draft branches side by side in the cache) ``keep(start, slots)`` moves the
  accepted path's entries down to consecutive slots from ``start`` and cuts the rest.
- A cache belongs to one run; a model holds weights only and can hand out many caches.
- Its size is checked against the memory the device has free before anything is allocated, so an
  absurd length (a huge max_new_tokens) is one clear error instead of an allocator failure or swap.
"""

from __future__ import annotations

import torch


def available_bytes(device: torch.device | str) -> int | None:
    """Memory free for new tensors on ``device`` (MemAvailable on a CPU, free memory on a GPU); None if unknown."""
    device = torch.device(device)
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        if device.type == "cpu":
            free = None
            with open("/proc/meminfo", encoding="ascii") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        free = int(line.split()[1]) * 1024
            return _address_space_left(free)
    except (OSError, RuntimeError, ValueError):
        pass
    return None


def _address_space_left(free: int | None) -> int | None:
    """``free``, lowered to what this process's address-space limit (RLIMIT_AS) still allows."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return free
    with open("/proc/self/statm", encoding="ascii") as f:
        used = int(f.read().split()[0]) * resource.getpagesize()
    left = max(0, limit - used)
    return left if free is None else min(free, left)


def check_fits(nbytes: int, device: torch.device | str, what: str) -> None:
    """Raise ValueError if ``nbytes`` more would not fit in ``device``'s free memory."""
    free = available_bytes(device)
    if free is not None and nbytes > free:
        raise ValueError(f"{what} needs {nbytes / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB of memory is free on "
                         f"{device}; lower max_new_tokens or shorten the prompt")


class KVCache:
    def __init__(self, num_layers: int, batch_size: int, capacity: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        for name, v in (("num_layers", num_layers), ("batch_size", batch_size), ("capacity", capacity),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"KVCache {name}={v!r}; expected a positive integer")
        shape = (batch_size, capacity, num_kv_heads, head_dim)
        itemsize = torch.empty((), dtype=dtype).element_size()
        check_fits(2 * num_layers * batch_size * capacity * num_kv_heads * head_dim * itemsize, device,
                   f"a KV cache of {capacity} positions ({num_layers} layers, {num_kv_heads} KV heads of {head_dim})")
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = 0
        self.capacity = capacity
        self.batch_size = batch_size

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def check_room(self, num_new: int) -> None:
        """Raise before writing if ``num_new`` more positions would not fit."""
        if self.length + num_new > self.capacity:
            raise ValueError(
                f"KV cache overflow: {self.length} positions cached + {num_new} new > capacity {self.capacity}; "
                "create the cache with a larger max_seq_len (model.new_cache(max_seq_len=...))")

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v [B, T, Hk, D]`` at slots ``length .. length+T-1`` of one layer.

        Returns that layer's valid keys and values ``[B, length+T, Hk, D]`` (views into the
        buffers). ``length`` itself moves only in ``advance``, once every layer has written.
        """
        t = k.shape[1]
        self.check_room(t)
        start = self.length
        self.k[layer][:, start:start + t] = k
        self.v[layer][:, start:start + t] = v
        return self.k[layer][:, :start + t], self.v[layer][:, :start + t]

    def advance(self, num_new: int) -> None:
        self.check_room(num_new)
        self.length += num_new

    def truncate(self, n: int) -> None:
        """Roll back to the first ``n`` positions (after a rejected draft)."""
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= self.length:
            raise ValueError(f"truncate(n={n!r}) needs 0 <= n <= length={self.length}")
        self.length = n

    def keep(self, start: int, slots) -> None:
        """Keep slots ``0 .. start-1`` and then only ``slots`` (increasing, each >= start), moved down to
        ``start, start+1, ...``; the length becomes ``start + len(slots)``.

        A tree verify writes every branch of the draft tree; this keeps the branch the acceptance took.
        """
        slots = list(slots)
        if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= self.length:
            raise ValueError(f"keep(start={start!r}) needs 0 <= start <= length={self.length}")
        if any(not isinstance(s, int) or isinstance(s, bool) for s in slots) or any(
                b <= a for a, b in zip(slots, slots[1:])) or (slots and not start <= slots[0] <= slots[-1] < self.length):
            raise ValueError(f"keep(start={start}, slots={slots}): slots must be increasing ints in "
                             f"[{start}, {self.length})")
        n = len(slots)
        if slots != list(range(start, start + n)):  # already in place: nothing to move
            idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
            for buf in (*self.k, *self.v):
                buf[:, start:start + n] = buf.index_select(1, idx)  # index_select copies: no overlap hazard
        self.length = start + n

    def reset(self) -> None:
        self.length = 0

    def __repr__(self) -> str:
        b, s, h, d = self.k[0].shape
        return (f"KVCache(layers={self.num_layers}, batch_size={b}, length={self.length}, capacity={s}, "
                f"kv_heads={h}, head_dim={d}, dtype={self.dtype})")
