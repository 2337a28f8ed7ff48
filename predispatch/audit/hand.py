"""Hand-written sample programs for CIA ops op_db misses or samples too gently.

Each program is ordinary user code; ``samples.record`` runs it under the ReachRecorder and
keeps the CIA calls it makes (label ``hand:<name>``).  The point of most of them is the
input that takes the other branch: the no-op conversion that returns ``self``, the
non-contiguous tensor ``reshape`` must copy, training mode with running statistics.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from predispatch.audit.samples import Program


def _r(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype)


def _batch_norm_train() -> object:
    return F.batch_norm(_r(4, 3, 5), torch.zeros(3), torch.ones(3), _r(3), _r(3), training=True)


def _batch_norm_eval() -> object:
    return F.batch_norm(_r(4, 3, 5), torch.zeros(3), torch.ones(3), _r(3), _r(3), training=False)


def _batch_norm_module() -> object:
    return torch.nn.BatchNorm2d(3).train()(_r(2, 3, 4, 4))


def _instance_norm_stats() -> object:
    x, mean, var = _r(2, 3, 5), torch.zeros(3), torch.ones(3)
    return F.instance_norm(x, mean, var, use_input_stats=True)


def _sdpa(**kwargs: object) -> Callable[[], object]:
    def run() -> object:
        q, k, v = _r(2, 4, 8, 16), _r(2, 4, 8, 16), _r(2, 4, 8, 16)
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

    return run


def _multihead_attention() -> object:
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = _r(2, 5, 16)
    return mha(x, x, x, need_weights=False)


def _recurrent(cls: type[torch.nn.Module]) -> Callable[[], object]:
    return lambda: cls(8, 16, batch_first=True)(_r(2, 5, 8))


def _packed(cls: Callable[[int, int], torch.nn.Module]) -> Callable[[], object]:
    def run() -> object:
        packed = torch.nn.utils.rnn.pack_padded_sequence(_r(5, 2, 8), torch.tensor([5, 3]))
        return cls(8, 16)(packed)

    return run


def _pad_packed() -> object:
    packed = torch.nn.utils.rnn.pack_padded_sequence(_r(5, 2, 8), torch.tensor([5, 3]))
    return torch.nn.utils.rnn.pad_packed_sequence(packed)


def _upsample_defaults() -> object:
    aten = torch.ops.aten
    return (aten.upsample_nearest1d.default(_r(1, 2, 4), [8]),
            aten.upsample_nearest2d.default(_r(1, 2, 4, 4), [8, 8]),
            aten.upsample_nearest3d.default(_r(1, 2, 2, 2, 2), [4, 4, 4]),
            aten.upsample_nearest3d.vec(_r(1, 2, 2, 2, 2), None, [2.0, 2.0, 2.0]),
            aten._upsample_nearest_exact1d.default(_r(1, 2, 4), [8]),
            aten._upsample_nearest_exact2d.default(_r(1, 2, 4, 4), [8, 8]),
            aten._upsample_nearest_exact3d.default(_r(1, 2, 2, 2, 2), [4, 4, 4]),
            aten._upsample_nearest_exact2d.vec(_r(1, 2, 4, 4), None, [2.0, 2.0]),
            aten._upsample_nearest_exact3d.vec(_r(1, 2, 2, 2, 2), None, [2.0, 2.0, 2.0]),
            aten._upsample_bicubic2d_aa.vec(_r(1, 2, 8, 8), [4, 4], False, None))


_PROGRAMS: dict[str, Callable[[], object]] = {
    # linear algebra and the common nn layers
    "linear": lambda: F.linear(_r(3, 4), _r(5, 4), _r(5)),
    "linear-no-bias-1d": lambda: F.linear(_r(4), _r(5, 4)),
    "linear-3d": lambda: F.linear(_r(2, 3, 4), _r(5, 4), _r(5)),
    "bilinear": lambda: F.bilinear(_r(3, 4), _r(3, 5), _r(6, 4, 5), _r(6)),
    "matmul-2d": lambda: torch.matmul(_r(3, 4), _r(4, 5)),
    "matmul-1d": lambda: torch.matmul(_r(4), _r(4)),
    "matmul-1d-2d": lambda: torch.matmul(_r(4), _r(4, 5)),
    "matmul-3d-2d": lambda: torch.matmul(_r(2, 3, 4), _r(4, 5)),
    "matmul-4d": lambda: torch.matmul(_r(2, 2, 3, 4), _r(2, 2, 4, 5)),
    "einsum-mm": lambda: torch.einsum("ij,jk->ik", _r(3, 4), _r(4, 5)),
    "einsum-bmm": lambda: torch.einsum("bij,bjk->bik", _r(2, 3, 4), _r(2, 4, 5)),
    "einsum-transpose": lambda: torch.einsum("ij->ji", _r(3, 4)),
    "einsum-diagonal": lambda: torch.einsum("ii->i", _r(4, 4)),
    "einsum-sum": lambda: torch.einsum("ij->", _r(3, 4)),
    "layer_norm": lambda: F.layer_norm(_r(2, 3, 4), (4,), _r(4), _r(4)),
    "layer_norm-no-affine": lambda: F.layer_norm(_r(2, 3, 4), (3, 4)),
    "rms_norm": lambda: F.rms_norm(_r(2, 3, 4), (4,), _r(4)),
    "group_norm": lambda: F.group_norm(_r(2, 6, 5), 3, _r(6), _r(6)),
    "batch_norm-train": _batch_norm_train,
    "batch_norm-eval": _batch_norm_eval,
    "batch_norm-no-stats": lambda: F.batch_norm(_r(4, 3, 5), None, None, training=True),
    "batch_norm-module": _batch_norm_module,
    "instance_norm-stats": _instance_norm_stats,
    "instance_norm": lambda: F.instance_norm(_r(2, 3, 5)),
    "conv1d": lambda: F.conv1d(_r(2, 3, 8), _r(4, 3, 3), _r(4)),
    "conv2d": lambda: F.conv2d(_r(2, 3, 8, 8), _r(4, 3, 3, 3), _r(4), padding=1),
    "conv2d-same": lambda: F.conv2d(_r(2, 3, 8, 8), _r(4, 3, 3, 3), padding="same"),
    "conv_transpose2d": lambda: F.conv_transpose2d(_r(2, 3, 4, 4), _r(3, 4, 3, 3)),
    "embedding": lambda: F.embedding(torch.tensor([[0, 2], [1, 3]]), _r(5, 4)),
    "embedding_bag": lambda: F.embedding_bag(torch.tensor([0, 2, 1, 3]), _r(5, 4),
                                             torch.tensor([0, 2])),
    "sdpa": _sdpa(),
    "sdpa-causal": _sdpa(is_causal=True),
    "sdpa-mask": lambda: F.scaled_dot_product_attention(
        _r(2, 4, 8, 16), _r(2, 4, 8, 16), _r(2, 4, 8, 16), attn_mask=_r(8, 8)),
    "sdpa-dropout": _sdpa(dropout_p=0.5),
    "sdpa-scale-gqa": lambda: F.scaled_dot_product_attention(
        _r(2, 4, 8, 16), _r(2, 2, 8, 16), _r(2, 2, 8, 16), scale=0.3, enable_gqa=True),
    "multihead_attention": _multihead_attention,
    "lstm": _recurrent(torch.nn.LSTM),
    "gru": _recurrent(torch.nn.GRU),
    "rnn": _recurrent(torch.nn.RNN),
    "gelu": lambda: F.gelu(_r(3, 4)),
    "gelu-tanh": lambda: F.gelu(_r(3, 4), approximate="tanh"),
    "softmax": lambda: F.softmax(_r(3, 4), dim=-1),
    "softmax-dtype": lambda: F.softmax(_r(3, 4), dim=-1, dtype=torch.float64),
    "log_softmax": lambda: F.log_softmax(_r(3, 4), dim=-1),
    "cross_entropy": lambda: F.cross_entropy(_r(3, 5), torch.tensor([0, 4, 2])),
    "cross_entropy-probs": lambda: F.cross_entropy(_r(3, 5), _r(3, 5).softmax(-1)),
    "interpolate-nearest": lambda: F.interpolate(_r(1, 2, 4, 4), scale_factor=2.0),
    "interpolate-bilinear": lambda: F.interpolate(_r(1, 2, 4, 4), size=(6, 6), mode="bilinear"),
    "pad-reflect": lambda: F.pad(_r(1, 2, 5), (1, 2), mode="reflect"),
    "pad-constant": lambda: F.pad(_r(2, 5), (1, 2), value=3.0),
    # dropout and friends, in training, evaluation and p = 0
    "dropout-train": lambda: F.dropout(_r(3, 4), 0.5, training=True),
    "dropout-eval": lambda: F.dropout(_r(3, 4), 0.5, training=False),
    "dropout-p0": lambda: torch.dropout(_r(3, 4), 0.0, True),
    "alpha_dropout-train": lambda: F.alpha_dropout(_r(3, 4), 0.5, training=True),
    "alpha_dropout-eval": lambda: torch.alpha_dropout(_r(3, 4), 0.5, False),
    "feature_dropout-train": lambda: F.dropout2d(_r(2, 3, 4, 4), 0.5, training=True),
    "feature_dropout-eval": lambda: torch.feature_dropout(_r(2, 3, 4, 4), 0.5, False),
    "feature_alpha_dropout-train": lambda: F.feature_alpha_dropout(_r(2, 3, 4), 0.5, True),
    "feature_alpha_dropout-eval": lambda: torch.feature_alpha_dropout(_r(2, 3, 4), 0.5, False),
    "rrelu-train": lambda: F.rrelu(_r(3, 4), training=True),
    "rrelu-eval": lambda: F.rrelu(_r(3, 4), training=False),
    # conversions that may return their input
    "to-same-dtype": lambda: _r(3, 4).to(torch.float32),
    "to-other-dtype": lambda: _r(3, 4).to(torch.float64),
    "to-copy": lambda: _r(3, 4).to(torch.float32, copy=True),
    "to-device": lambda: _r(3, 4).to("cpu"),
    "to-device-dtype": lambda: _r(3, 4).to("cpu", torch.float64),
    "to-tensor-same": lambda: _r(3, 4).to(_r(2)),
    "to-tensor-other": lambda: _r(3, 4).to(_r(2, dtype=torch.float64)),
    "to-other-op-same": lambda: torch.ops.aten.to.other(_r(3, 4), _r(2)),  # Python never
    "to-other-op-other": lambda: torch.ops.aten.to.other(  # calls this overload itself
        _r(3, 4), _r(2, dtype=torch.float64)),
    "to-keywords": lambda: _r(3, 4).to(dtype=torch.float32, device="cpu"),
    "to-channels-last": lambda: _r(2, 3, 4, 4).to(memory_format=torch.channels_last),
    "float-noop": lambda: _r(3, 4).float(),
    "double": lambda: _r(3, 4).double(),
    "type_as-same": lambda: _r(3, 4).type_as(_r(2)),
    "type_as-other": lambda: _r(3, 4).type_as(_r(2, dtype=torch.float64)),
    "type-same": lambda: _r(3, 4).type(torch.float32),
    "chalf-noop": lambda: torch.zeros(3, dtype=torch.chalf).chalf(),
    "contiguous-already": lambda: _r(3, 4).contiguous(),
    "contiguous-transposed": lambda: _r(4, 3).t().contiguous(),
    # shape ops that view or copy depending on strides
    "reshape-contiguous": lambda: _r(3, 4).reshape(12),
    "reshape-transposed": lambda: _r(4, 3).t().reshape(12),
    "reshape_as": lambda: _r(4, 3).t().reshape_as(_r(12)),
    "flatten-contiguous": lambda: _r(2, 3, 4).flatten(),
    "flatten-transposed": lambda: _r(4, 3).t().flatten(),
    "flatten-noop": lambda: _r(5).flatten(),
    "unflatten": lambda: _r(2, 12).unflatten(1, (3, 4)),
    "expand_as": lambda: _r(1, 4).expand_as(_r(3, 4)),
    "view_as": lambda: _r(3, 4).view_as(_r(12)),
    "chunk": lambda: _r(6, 4).chunk(3),
    "unsafe_chunk": lambda: torch.unsafe_chunk(_r(6, 4), 3),
    "unsafe_split": lambda: torch.unsafe_split(_r(6, 4), 2),
    "split": lambda: _r(6, 4).split([2, 4]),
    "atleast_2d-noop": lambda: torch.atleast_2d(_r(3, 4)),
    "squeeze-noop": lambda: _r(3, 4).squeeze(),
    "cat": lambda: torch.cat([_r(2, 3), _r(4, 3)]),
    "concat-single": lambda: torch.concat([_r(2, 3)]),
    # recurrent layers beyond the plain ones: cells, packed sequences, dropout between layers
    "lstm-dropout-train": lambda: torch.nn.LSTM(8, 16, num_layers=2, dropout=0.5)(_r(5, 2, 8)),
    "rnn-relu": lambda: torch.nn.RNN(8, 16, nonlinearity="relu")(_r(5, 2, 8)),
    "lstm-packed": _packed(torch.nn.LSTM),
    "gru-packed": _packed(torch.nn.GRU),
    "rnn-tanh-packed": _packed(torch.nn.RNN),
    "rnn-relu-packed": _packed(lambda i, h: torch.nn.RNN(i, h, nonlinearity="relu")),
    "lstm_cell": lambda: torch.nn.LSTMCell(8, 16)(_r(2, 8)),
    "gru_cell": lambda: torch.nn.GRUCell(8, 16)(_r(2, 8)),
    "rnn_tanh_cell": lambda: torch.nn.RNNCell(8, 16)(_r(2, 8)),
    "rnn_relu_cell": lambda: torch.nn.RNNCell(8, 16, nonlinearity="relu")(_r(2, 8)),
    # resampling, convolution and padding variants
    "interpolate-nearest-1d": lambda: F.interpolate(_r(1, 2, 4), scale_factor=2.0),
    "interpolate-nearest-3d": lambda: F.interpolate(_r(1, 2, 2, 2, 2), scale_factor=2.0),
    "interpolate-nearest-size": lambda: F.interpolate(_r(1, 2, 4, 4), size=(8, 8)),
    "interpolate-nearest-exact": lambda: F.interpolate(_r(1, 2, 4, 4), scale_factor=2.0,
                                                       mode="nearest-exact"),
    "interpolate-nearest-exact-1d": lambda: F.interpolate(_r(1, 2, 4), size=8,
                                                          mode="nearest-exact"),
    "interpolate-nearest-exact-3d": lambda: F.interpolate(_r(1, 2, 2, 2, 2), size=(4, 4, 4),
                                                          mode="nearest-exact"),
    "upsample_nearest-defaults": _upsample_defaults,
    "interpolate-bicubic-aa": lambda: F.interpolate(_r(1, 2, 8, 8), size=(4, 4), mode="bicubic",
                                                    antialias=True),
    "lanczos-aa": lambda: torch.ops.aten._upsample_lanczos2d_aa.vec(_r(1, 2, 8, 8), [4, 4],
                                                                    False, None),
    "conv1d-same": lambda: F.conv1d(_r(2, 3, 8), _r(4, 3, 3), padding="same"),
    "conv3d": lambda: F.conv3d(_r(1, 2, 4, 4, 4), _r(3, 2, 3, 3, 3)),
    "thnn_conv2d": lambda: torch._C._nn.thnn_conv2d(_r(1, 2, 5, 5), _r(3, 2, 3, 3), [3, 3]),
    "slow_conv3d": lambda: torch._C._nn.slow_conv3d(_r(1, 2, 4, 4, 4), _r(3, 2, 3, 3, 3),
                                                    [3, 3, 3]),
    "channel_shuffle": lambda: torch.native_channel_shuffle(_r(1, 4, 3, 3), 2),
    "embedding_bag-default": lambda: torch.ops.aten.embedding_bag.default(
        _r(5, 4), torch.tensor([0, 2, 1, 3]), torch.tensor([0, 2])),
    "pad_packed_sequence": _pad_packed,
    # reductions and linear algebra entry points op_db reaches only through other overloads
    "quantile-tensor": lambda: torch.quantile(_r(3, 4), torch.tensor([0.25, 0.5])),
    "nanquantile-tensor": lambda: torch.nanquantile(_r(3, 4), torch.tensor([0.25, 0.5])),
    "slogdet": lambda: torch.slogdet(_r(3, 3)),
    "vander": lambda: torch.vander(_r(4)),
    "meshgrid-default": lambda: torch.meshgrid(_r(3), _r(4)),
    "chain_matmul": lambda: torch.chain_matmul(_r(2, 3), _r(3, 4), _r(4, 5)),
    "linalg_norm-fro": lambda: torch.linalg.norm(_r(3, 4), "fro"),
    "linalg_cond-fro": lambda: torch.linalg.cond(_r(3, 3), "fro"),
    "frobenius_norm": lambda: torch.frobenius_norm(_r(3, 4), [0, 1]),
    "nuclear_norm-dim": lambda: torch.nuclear_norm(_r(3, 4), [0, 1]),
    "gradient-spacing": lambda: torch.gradient(_r(3, 4), spacing=[_r(3), _r(4)]),
    "gradient-scalars": lambda: torch.gradient(_r(3, 4), spacing=[2.0, 3.0]),
    "gradient-scalar-dims": lambda: torch.gradient(_r(3, 4), spacing=[2.0], dim=[1]),
    "sum_to_size-noop": lambda: _r(3, 4).sum_to_size(3, 4),
    "sum_to_size": lambda: _r(3, 4).sum_to_size(1, 4),
    "where-scalar": lambda: torch.where(_r(3, 4) > 0, _r(3, 4), 0.0),
    "where-scalar-self": lambda: torch.where(_r(3, 4) > 0, 1.0, _r(3, 4)),
    "where-scalars": lambda: torch.where(_r(3, 4) > 0, 1.0, 0.0),
    "fake_quantize-channel": lambda: torch.fake_quantize_per_channel_affine(
        _r(3, 4), torch.ones(4), torch.zeros(4, dtype=torch.int32), 1, 0, 255),
    "fake_quantize-tensor-qparams": lambda: torch.fake_quantize_per_tensor_affine(
        _r(3, 4), torch.tensor(0.1), torch.tensor(0), 0, 255),
    "to_sparse-twice": lambda: _r(3, 4).to_sparse().to_sparse(),
    "sparse_coo_tensor": lambda: torch.sparse_coo_tensor(torch.tensor([[0, 1], [2, 0]]),
                                                         _r(2), (3, 4)),
    "sparse_coo_tensor-no-size": lambda: torch.sparse_coo_tensor(torch.tensor([[0, 1], [2, 0]]),
                                                                 _r(2)),
    "sparse_csr_tensor-no-size": lambda: torch.sparse_csr_tensor(
        torch.tensor([0, 1, 2]), torch.tensor([0, 1]), _r(2)),
    "sparse_csr_tensor": lambda: torch.sparse_csr_tensor(torch.tensor([0, 1, 2]),
                                                         torch.tensor([0, 1]), _r(2), (2, 2)),
    "reshape_from_tensor": lambda: torch._reshape_from_tensor(_r(3, 4), torch.tensor([4, 3])),
    # data-dependent and odd ones
    "where-single": lambda: torch.where(_r(3, 4) > 0),
    "data": lambda: torch.ops.aten.data(_r(3, 4)),
    "cast-float-noop": lambda: torch.ops.aten._cast_Float(_r(3, 4)),
}

HAND_PROGRAMS: tuple[Program, ...] = tuple(Program(f"hand:{k}", v) for k, v in _PROGRAMS.items())
