"""A contiguous KV cache that stores K and V quantized: the model runs on it unchanged.

Same protocol as :class:`~kvcourse.KVCache`: ``update(layer_idx, k, v)`` stores the new tokens and
returns the layer's whole history, here *dequantized* (what attention reads back from a quantized
cache, with its rounding error), and ``seq_len`` counts the tokens. ``nbytes`` counts what is really
held: codes, scales, zero points and the full-precision window.

Schemes (``scheme``, ``bits``):

* ``"per-token"`` with ``bits`` 8, 4 or 2: every cached vector (one token, one head, ``D`` values)
  is one group, for K and for V. Simple, and what a paged kernel reads most easily.
* ``"kivi"`` with ``bits`` 8, 4 or 2 (Liu et al., *KIVI*, ICML 2024): **keys per channel**, one group
  per channel over ``group_size`` consecutive tokens, **values per token**. The newest tokens wait in a
  full-precision (fp16) window until a whole group of keys can be quantized: the window holds between
  ``residual_length`` and ``residual_length + group_size - 1`` tokens.
* ``"fp8"`` (``bits=8``): e4m3 with one fp16 scale per vector; ``"fp16"``, ``"bf16"`` (``bits=16``):
  the casts a GPU server stores, the baselines.

``residual_length`` applies to every scheme (default 0, and 128 for KIVI as in the paper).
"""

from __future__ import annotations

import torch

from ..cache import CacheOverflowError, check_update
from ..checks import check_bool, check_int, check_ints
from ..utils import check_config
from .quantization import QuantizedTensor, dequantize, quantize

__all__ = ["QuantizedKVCache", "SCHEMES"]

# scheme -> the bit widths it accepts
SCHEMES = {"per-token": (2, 4, 8), "kivi": (2, 4, 8), "fp8": (8,), "fp16": (16,), "bf16": (16,)}
RESIDUAL_DTYPE = torch.float16  # the full-precision window, stored as a GPU server would


class _Growing:
    """A tensor that grows along axis 2 (tokens or groups) by doubling, as KVCache's storage does."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.n = 0

    def append(self, x: torch.Tensor) -> None:
        need = self.n + x.shape[2]
        if self.buf is None or need > self.buf.shape[2]:
            capacity = max(need, 16 if self.buf is None else 2 * self.buf.shape[2])
            grown = x.new_empty((*x.shape[:2], capacity, *x.shape[3:]))
            if self.buf is not None:
                grown[:, :, : self.n] = self.buf[:, :, : self.n]
            self.buf = grown
        self.buf[:, :, self.n : need] = x
        self.n = need

    def view(self) -> torch.Tensor | None:
        return None if self.buf is None else self.buf[:, :, : self.n]

    @property
    def nbytes(self) -> int:
        live = self.view()
        return 0 if live is None else live.numel() * live.element_size()


class _Layer:
    """One layer's quantized K and V, and its full-precision window of recent tokens."""

    def __init__(self) -> None:
        self.k, self.k_scale, self.k_zero = _Growing(), _Growing(), _Growing()
        self.v, self.v_scale, self.v_zero = _Growing(), _Growing(), _Growing()
        self.res_k: torch.Tensor | None = None
        self.res_v: torch.Tensor | None = None
        self.length = 0

    def stores(self) -> list[_Growing]:
        return [self.k, self.k_scale, self.k_zero, self.v, self.v_scale, self.v_zero]


class QuantizedKVCache:
    """Per-layer K/V for ``batch_size`` sequences, stored quantized (see the module docstring).

    Args:
        num_layers, batch_size, num_kv_heads, head_dim: the cache's shape, as for ``KVCache``.
        bits: bits per stored value (2, 4 or 8 for the integer schemes, 8 for fp8, 16 for fp16/bf16).
        scheme: ``"per-token"``, ``"kivi"``, ``"fp8"``, ``"fp16"`` or ``"bf16"``.
        group_size: tokens per key group under ``"kivi"`` (KIVI's G).
        residual_length: newest tokens kept in fp16 (KIVI's R); ``None``: 128 for kivi, else 0.
        max_seq_len: the most tokens the cache may hold; ``None`` for no limit.
        quantize_prefill: ``True`` (default): the prompt's own forward already reads its K/V quantized, as
            every later token does (what a perplexity over one prefill measures). ``False``: it reads them
            unrounded and only later steps read the quantized history, as KIVI's reference code and Hugging
            Face's ``QuantizedCache`` do.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        bits: int = 8,
        scheme: str = "per-token",
        group_size: int = 32,
        residual_length: int | None = None,
        max_seq_len: int | None = None,
        quantize_prefill: bool = True,
    ) -> None:
        check_bool("quantize_prefill", quantize_prefill)
        check_ints(num_layers=num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   group_size=group_size)  # fmt: skip
        if scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {list(SCHEMES)}, got {scheme!r}")
        if bits not in SCHEMES[scheme]:
            raise ValueError(f"bits must be one of {SCHEMES[scheme]} for scheme {scheme!r}, got {bits!r}")
        if bits < 8 and head_dim % (8 // bits):
            raise ValueError(f"head_dim ({head_dim}) must be a multiple of {8 // bits} to pack {bits}-bit codes")
        if residual_length is None:
            residual_length = 128 if scheme == "kivi" else 0
        check_int("residual_length", residual_length, min=0)
        check_int("max_seq_len", max_seq_len, min=1, none_ok=True)
        self.num_layers, self.batch_size = num_layers, batch_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.bits, self.scheme, self.group_size = bits, scheme, group_size
        self.residual_length, self.max_seq_len = residual_length, max_seq_len
        self.quantize_prefill = quantize_prefill
        self.fmt = {"per-token": f"int{bits}", "kivi": f"int{bits}"}.get(scheme, scheme)
        # Tokens leave the window a whole key group at a time under KIVI, one at a time otherwise.
        self.flush_unit = group_size if scheme == "kivi" else 1
        self._layers = [_Layer() for _ in range(num_layers)]

    @classmethod
    def for_model(
        cls,
        config,
        batch_size: int = 1,
        bits: int = 8,
        scheme: str = "per-token",
        group_size: int = 32,
        residual_length: int | None = None,
        max_seq_len: int | None = None,
        quantize_prefill: bool = True,
    ) -> QuantizedKVCache:
        """A cache shaped for ``config`` (``model.config``); ``max_seq_len`` defaults to its context length."""
        check_config(config)
        return cls(config.num_hidden_layers, batch_size, config.num_key_value_heads, config.head_dim, bits, scheme,
                   group_size, residual_length,
                   config.max_position_embeddings if max_seq_len is None else max_seq_len,
                   quantize_prefill)  # fmt: skip

    # ---- what the model calls -------------------------------------------------
    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v [B, H_kv, T, D]``; return the layer's whole history, dequantized, in ``k``'s dtype."""
        check_update(self, layer_idx, k, v)
        layer = self._layers[layer_idx]
        first = layer.length == 0  # this forward is the prefill
        if self.max_seq_len is not None and layer.length + k.shape[2] > self.max_seq_len:
            raise CacheOverflowError(
                f"KV cache overflow: layer {layer_idx} holds {layer.length} tokens and {k.shape[2]} more would "
                f"exceed max_seq_len={self.max_seq_len}"
            )
        res_k, res_v = k.to(RESIDUAL_DTYPE), v.to(RESIDUAL_DTYPE)
        if layer.res_k is not None:
            res_k, res_v = torch.cat([layer.res_k, res_k], 2), torch.cat([layer.res_v, res_v], 2)
        # Quantize what falls out of the window, in whole flush units.
        n_flush = (res_k.shape[2] - self.residual_length) // self.flush_unit * self.flush_unit
        if n_flush > 0:
            self._store(layer, res_k[:, :, :n_flush].to(k.dtype), res_v[:, :, :n_flush].to(v.dtype))
            res_k, res_v = res_k[:, :, n_flush:], res_v[:, :, n_flush:]
        layer.res_k, layer.res_v = res_k, res_v
        layer.length += k.shape[2]
        if first and not self.quantize_prefill:  # the prompt attends to its own K/V unrounded; later steps do not
            return k, v
        return self._read(layer, k.dtype)

    def _store(self, layer: _Layer, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.scheme == "kivi":  # keys: one group per channel over each run of group_size tokens
            b, h, t, d = k.shape
            qk = quantize(k.reshape(b, h, t // self.group_size, self.group_size, d), self.fmt, dim=-2)
            layer.k.append(qk.data.reshape(b, h, t, -1))
            layer.k_scale.append(qk.scale[:, :, :, 0])  # [B, H, groups, D]
            layer.k_zero.append(qk.zero[:, :, :, 0])
        else:
            self._append(layer.k, layer.k_scale, layer.k_zero, quantize(k, self.fmt, dim=-1))
        self._append(layer.v, layer.v_scale, layer.v_zero, quantize(v, self.fmt, dim=-1))

    @staticmethod
    def _append(data: _Growing, scale: _Growing, zero: _Growing, qt: QuantizedTensor) -> None:
        data.append(qt.data)
        if qt.scale is not None:
            scale.append(qt.scale)
        if qt.zero is not None:
            zero.append(qt.zero)

    def _read(self, layer: _Layer, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = [], []
        if layer.k.n:
            if self.scheme == "kivi":
                b, h, t, packed = layer.k.view().shape
                g = self.group_size
                qk = QuantizedTensor(layer.k.view().reshape(b, h, t // g, g, packed), layer.k_scale.view()[:, :, :, None],
                                     layer.k_zero.view()[:, :, :, None], self.fmt)  # fmt: skip
                keys.append(dequantize(qk, dtype).reshape(b, h, t, self.head_dim))
            else:
                keys.append(
                    dequantize(
                        QuantizedTensor(layer.k.view(), layer.k_scale.view(), layer.k_zero.view(), self.fmt), dtype
                    )
                )
            values.append(
                dequantize(QuantizedTensor(layer.v.view(), layer.v_scale.view(), layer.v_zero.view(), self.fmt), dtype)
            )
        keys.append(layer.res_k.to(dtype))
        values.append(layer.res_v.to(dtype))
        return torch.cat(keys, 2), torch.cat(values, 2)

    # ---- what readers look at -------------------------------------------------
    @property
    def seq_len(self) -> int:
        """Tokens cached per sequence (the same in every layer between forward passes)."""
        return self._layers[0].length

    def keys(self, layer_idx: int) -> torch.Tensor:
        """Layer ``layer_idx``'s keys as attention reads them (dequantized, fp32), ``[B, H_kv, seq_len, D]``."""
        return self._read_or_empty(layer_idx)[0]

    def values(self, layer_idx: int) -> torch.Tensor:
        """Layer ``layer_idx``'s values as attention reads them (dequantized, fp32), ``[B, H_kv, seq_len, D]``."""
        return self._read_or_empty(layer_idx)[1]

    def _read_or_empty(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self._layers[layer_idx]
        if layer.res_k is None:  # nothing stored yet, so no device to follow: an empty tensor on the host
            empty = torch.empty(self.batch_size, self.num_kv_heads, 0, self.head_dim, device="cpu")
            return empty, empty
        return self._read(layer, torch.float32)

    @property
    def nbytes(self) -> int:
        """Bytes held for the cached tokens: codes, scales, zero points and the fp16 window, every layer."""
        total = 0
        for layer in self._layers:
            total += sum(s.nbytes for s in layer.stores())
            if layer.res_k is not None:
                total += 2 * layer.res_k.numel() * layer.res_k.element_size()
        return total

    @property
    def bytes_per_token(self) -> float:
        """``nbytes`` per cached token of one sequence (scales and the window spread over the tokens)."""
        return self.nbytes / (self.batch_size * self.seq_len) if self.seq_len else float("nan")

    def __len__(self) -> int:
        return self.seq_len

    def __repr__(self) -> str:
        window = f", residual_length={self.residual_length}" if self.residual_length else ""
        group = f", group_size={self.group_size}" if self.scheme == "kivi" else ""
        return (
            f"QuantizedKVCache(scheme={self.scheme!r}, bits={self.bits}{group}{window}, layers={self.num_layers}, "
            f"batch={self.batch_size}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"seq_len={self.seq_len}, nbytes={self.nbytes:,})"
        )
