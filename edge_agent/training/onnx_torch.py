"""Rebuild a trainable torch module from an ONNX segment: the segment is the architecture.

The agent never ships model code: it interprets the segment's nodes with torch functions, and
the segment's floating-point initializers become ``nn.Parameter`` s. Ops covered: Conv, Relu,
LeakyRelu, Sigmoid, Tanh, MaxPool, AveragePool, GlobalAveragePool, Flatten, Reshape, Gemm,
MatMul, Add, Sub, Mul, Identity, Dropout (as identity). Anything else raises
:class:`UnsupportedOpError` before training starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from torch import nn

from edge_agent.training.errors import UnsupportedOpError

_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16)
Tensor = torch.Tensor


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _pads(attrs: Mapping[str, Any], dims: int) -> tuple[int, ...]:
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET", b"VALID", "VALID"):
        raise UnsupportedOpError(f"auto_pad={attrs['auto_pad']!r} is not supported")
    pads = list(attrs.get("pads", [0] * (2 * dims)))
    if pads[:dims] != pads[dims:]:
        raise UnsupportedOpError(f"asymmetric pads {pads} are not supported")
    return tuple(int(p) for p in pads[:dims])


def _conv(x: Tensor, w: Tensor, b: Tensor | None, a: Mapping[str, Any]) -> Tensor:
    dims = w.dim() - 2
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[dims]
    return conv(
        x,
        w,
        b,
        stride=tuple(a.get("strides", [1] * dims)),
        padding=_pads(a, dims),
        dilation=tuple(a.get("dilations", [1] * dims)),
        groups=int(a.get("group", 1)),
    )


def _pool(kind: str, x: Tensor, a: Mapping[str, Any]) -> Tensor:
    kernel = tuple(a["kernel_shape"])
    dims = len(kernel)
    strides = tuple(a.get("strides", [1] * dims))
    ceil = bool(a.get("ceil_mode", 0))
    if kind == "max":
        pool = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[dims]
        return pool(x, kernel, strides, _pads(a, dims), ceil_mode=ceil)
    avg = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[dims]
    include = bool(a.get("count_include_pad", 0))
    return avg(x, kernel, strides, _pads(a, dims), ceil, include)


def _gemm(i: Sequence[Tensor], a: Mapping[str, Any]) -> Tensor:
    x = i[0].t() if a.get("transA", 0) else i[0]
    w = i[1].t() if a.get("transB", 0) else i[1]
    out = float(a.get("alpha", 1.0)) * (x @ w)
    if len(i) > 2:
        out = out + float(a.get("beta", 1.0)) * i[2]
    return out


def _reshape(x: Tensor, shape: Tensor, a: Mapping[str, Any]) -> Tensor:
    dims = [int(d) for d in shape.tolist()]
    if not a.get("allowzero", 0):
        dims = [x.shape[k] if d == 0 else d for k, d in enumerate(dims)]
    return x.reshape(dims)


_OPS: dict[str, Callable[[Sequence[Tensor], Mapping[str, Any]], Tensor]] = {
    "Conv": lambda i, a: _conv(i[0], i[1], i[2] if len(i) > 2 else None, a),
    "Relu": lambda i, a: F.relu(i[0]),
    "LeakyRelu": lambda i, a: F.leaky_relu(i[0], float(a.get("alpha", 0.01))),
    "Sigmoid": lambda i, a: torch.sigmoid(i[0]),
    "Tanh": lambda i, a: torch.tanh(i[0]),
    "MaxPool": lambda i, a: _pool("max", i[0], a),
    "AveragePool": lambda i, a: _pool("avg", i[0], a),
    "GlobalAveragePool": lambda i, a: i[0].mean(dim=tuple(range(2, i[0].dim())), keepdim=True),
    "Flatten": lambda i, a: i[0].reshape(
        math.prod(i[0].shape[: int(a.get("axis", 1))]),
        -1,
    ),
    "Reshape": lambda i, a: _reshape(i[0], i[1], a),
    "Gemm": _gemm,
    "MatMul": lambda i, a: i[0] @ i[1],
    "Add": lambda i, a: i[0] + i[1],
    "Sub": lambda i, a: i[0] - i[1],
    "Mul": lambda i, a: i[0] * i[1],
    "Identity": lambda i, a: i[0],
    "Dropout": lambda i, a: i[0],
}


class OnnxSegmentModule(nn.Module):
    """A torch module computing an ONNX segment, with its float initializers as parameters."""

    def __init__(self, segment: onnx.ModelProto) -> None:
        super().__init__()
        graph = segment.graph
        unsupported = sorted({n.op_type for n in graph.node if n.op_type not in _OPS})
        if unsupported or any(n.domain not in ("", "ai.onnx") for n in graph.node):
            raise UnsupportedOpError(f"cannot rebuild ops {unsupported} in torch")
        self.weight_names: list[str] = []
        self._slots: dict[str, str] = {}
        self.weights = nn.ParameterList()
        self._constants: dict[str, Tensor] = {}
        for tensor in graph.initializer:
            array = numpy_helper.to_array(tensor)
            if tensor.data_type in _FLOATS:
                self._slots[tensor.name] = str(len(self.weights))
                self.weights.append(nn.Parameter(torch.from_numpy(array.astype(np.float32).copy())))
                self.weight_names.append(tensor.name)
            else:
                self._constants[tensor.name] = torch.from_numpy(array.copy())
        init_names = set(self._slots) | set(self._constants)
        self.input_names = [v.name for v in graph.input if v.name not in init_names]
        self.output_names = [v.name for v in graph.output]
        self._nodes = [(n.op_type, list(n.input), list(n.output), _attrs(n)) for n in graph.node]

    def named_weights(self) -> dict[str, nn.Parameter]:
        """ONNX initializer name -> parameter."""
        return {name: self.weights[int(self._slots[name])] for name in self.weight_names}

    def load_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Overwrite weights by initializer name (shapes must match)."""
        params = self.named_weights()
        with torch.no_grad():
            for name, array in arrays.items():
                target = params[name]
                if tuple(array.shape) != tuple(target.shape):
                    raise UnsupportedOpError(
                        f"{name}: shape {array.shape} != {tuple(target.shape)}"
                    )
                target.copy_(torch.from_numpy(np.asarray(array, dtype=np.float32)))

    def arrays(self) -> dict[str, np.ndarray]:
        """Current weights by initializer name."""
        return {n: p.detach().cpu().numpy().copy() for n, p in self.named_weights().items()}

    def forward(self, *inputs: Tensor) -> Tensor | tuple[Tensor, ...]:
        """Run the nodes in graph order; one output returns a tensor, several a tuple."""
        env: dict[str, Tensor] = dict(zip(self.input_names, inputs, strict=True))
        env.update(self._constants)
        for name, slot in self._slots.items():
            env[name] = self.weights[int(slot)]
        for op, ins, outs, attrs in self._nodes:
            env[outs[0]] = _OPS[op]([env[n] for n in ins if n], attrs)
        results = tuple(env[n] for n in self.output_names)
        return results[0] if len(results) == 1 else results

    def activation_elements(self, *inputs: Tensor) -> int:
        """Elements per example of every tensor the nodes produce (saved for backward)."""
        with torch.no_grad():
            env: dict[str, Tensor] = dict(zip(self.input_names, inputs, strict=True))
            env.update(self._constants)
            env.update({n: self.weights[int(s)] for n, s in self._slots.items()})
            total = 0
            for op, ins, outs, attrs in self._nodes:
                out = _OPS[op]([env[n] for n in ins if n], attrs)
                env[outs[0]] = out
                total += out.numel() // max(1, out.shape[0] if out.dim() else 1)
        return total
