"""Device memory that is given back and taken again at the same address (CUDA virtual memory).

- ``VmmBuffer(nbytes, device)``: ``release()`` frees the physical memory and keeps the
  addresses; ``reacquire()`` maps new memory there, so CUDA graphs captured over its tensor stay
  valid. Contents do not survive a release.
- ``available(device)``: whether the driver offers this; elsewhere the KV pool is an ordinary
  allocation.
- A driver error raises ``RuntimeError`` naming the call and the error code.

It knows nothing of KV caches; ``graph_runner.py`` keeps its pool here on a GPU.
"""
from __future__ import annotations

import ctypes
import functools

import torch

_SUCCESS, _OUT_OF_MEMORY = 0, 2
_PINNED, _LOCATION_DEVICE, _READ_WRITE = 1, 1, 3


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


@functools.lru_cache(maxsize=1)
def _driver():
    return ctypes.CDLL("libcuda.so.1")


def _check(code: int, call: str, nbytes: int = 0) -> None:
    if code == _OUT_OF_MEMORY:
        raise RuntimeError(f"{call}: out of device memory for {nbytes / 2**30:.2f} GiB (CUDA error 2)")
    if code != _SUCCESS:
        raise RuntimeError(f"{call} failed with CUDA driver error {code}")


def available(device: torch.device) -> bool:
    """``available(device)``: whether the driver offers this (CUDA and libcuda
    with virtual memory management); the KV pool falls back to an ordinary
    allocation, and graphs recaptured after a release, where it does not.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        _driver()
        VmmBuffer._granularity(device.index if device.index is not None else torch.cuda.current_device())
    except (OSError, AttributeError, RuntimeError):
        return False
    return True


class _ArrayInterface:
    """A device range as ``__cuda_array_interface__`` (bytes), for ``torch.as_tensor``."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class VmmBuffer:
    """``VmmBuffer(nbytes, device)`` reserves a virtual address range on a CUDA
    device and maps physical memory into it (the driver's ``cuMemAddressReserve``
    / ``cuMemCreate`` / ``cuMemMap``, through ctypes: no extension to build).
    ``tensor(dtype, shape)`` is a torch tensor over that range (it does not own
    the memory). ``release()`` unmaps and frees the physical memory, keeping the
    addresses; ``reacquire()`` maps new physical memory at the same addresses,
    so CUDA graphs captured over the tensor stay valid (their kernels hold
    addresses, not allocations). Contents do not survive a release.
    A driver error raises ``RuntimeError`` naming the call and the error code;
    out of memory on ``reacquire`` names the bytes asked for.
    """
    def __init__(self, nbytes: int, device: torch.device):
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        gran = self._granularity(self.device_index)
        self.nbytes = -(-int(nbytes) // gran) * gran
        self._prop = self._make_prop(self.device_index)
        ptr = ctypes.c_uint64()
        _check(_driver().cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(self.nbytes), ctypes.c_size_t(0),
                                             ctypes.c_uint64(0), ctypes.c_uint64(0)), "cuMemAddressReserve")
        self.ptr = ptr.value
        self._handle: int | None = None
        self.reacquire()

    @staticmethod
    def _make_prop(index: int) -> _Prop:
        prop = _Prop()
        prop.type, prop.requestedHandleTypes = _PINNED, 0
        prop.location = _Location(_LOCATION_DEVICE, index)
        return prop

    @classmethod
    def _granularity(cls, index: int) -> int:
        torch.cuda.set_device(index)  # the device's primary context is current on this thread
        gran = ctypes.c_size_t()
        prop = cls._make_prop(index)
        _check(_driver().cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0),
               "cuMemGetAllocationGranularity")
        return gran.value

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        raw = torch.as_tensor(_ArrayInterface(self.ptr, self.nbytes), device=f"cuda:{self.device_index}")
        count = 1
        for s in shape:
            count *= s
        return raw[: count * torch.empty(0, dtype=dtype).element_size()].view(dtype).view(shape)

    def reacquire(self) -> None:
        """Map physical memory at the reserved addresses again (a no-op while mapped)."""
        if self._handle is not None:
            return
        torch.cuda.set_device(self.device_index)
        lib, handle = _driver(), ctypes.c_uint64()
        _check(lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.nbytes), ctypes.byref(self._prop),
                               ctypes.c_uint64(0)), "cuMemCreate", self.nbytes)
        try:
            _check(lib.cuMemMap(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.nbytes), ctypes.c_size_t(0),
                                handle, ctypes.c_uint64(0)), "cuMemMap")
        except RuntimeError:
            lib.cuMemRelease(handle)
            raise
        access = _Access(_Location(_LOCATION_DEVICE, self.device_index), _READ_WRITE)
        _check(lib.cuMemSetAccess(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.nbytes), ctypes.byref(access),
                                  ctypes.c_size_t(1)), "cuMemSetAccess")
        self._handle = handle.value

    def release(self) -> None:
        """Give the physical memory back to the driver; the addresses stay reserved."""
        if self._handle is None:
            return
        torch.cuda.synchronize(self.device_index)  # no kernel may still read or write the range
        lib = _driver()
        _check(lib.cuMemUnmap(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.nbytes)), "cuMemUnmap")
        _check(lib.cuMemRelease(ctypes.c_uint64(self._handle)), "cuMemRelease")
        self._handle = None
