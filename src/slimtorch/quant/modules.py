"""Quantized layers whose buffers are the slim format's codec parts, so they save and load as they are.

A quantized layer keeps its weight as the parts the ``int8`` or ``int4`` codec writes (codes, scales,
zero points) in buffers, and knows the codec stage that made them. :func:`slimtorch.save_model` stores
them as the coded tensor ``<layer>.weight`` (any slim reader decodes it to the float weight), and
:func:`slimtorch.load_model` maps them back into the layer's buffers: no dequantize, no re-quantize.

``SLIM_PARTS`` tells the loader which buffer holds which part: ``{"qweight": ("weight", "q"), ...}``.

Layers: :class:`Int8DynamicLinear` (int8 weights and activations), :class:`Int8WeightLinear` and
:class:`Int4WeightLinear` (weight-only, float activations), :class:`Int8Embedding` and
:class:`Int4Embedding` (rows dequantized as they are looked up); convolutions are in
:mod:`slimtorch.quant.conv`, and :mod:`slimtorch.quant.build` makes any of them. They are for
inference: nothing in them trains; they compute without autograd, so no gradient flows through them.
Under ``torch.compile`` (``fullgraph=True`` included) each runs its eager kernels as one operator (see
:mod:`slimtorch.quant.kernels`), but for an int8-dynamic Linear at a fixed batch size, which is traced
around its kernel (:meth:`Int8DynamicLinear.compiled_forward`); embeddings are traced, their lookup and
dequantization fused.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from slimtorch.format import pages
from slimtorch.format.codecs import Encoded
from slimtorch.format.codecs.chain import parse_dtype
from slimtorch.format.codecs.lossy import INT4, INT8, QUANTIZERS, decoded_blocks
from slimtorch.format.source import dtype_name
from slimtorch.quant import kernels, rowcodes, sharing
from slimtorch.quant.kernels import BF16_AGREEMENT, CHOICES

# Which buffer holds which part of the coded tensor ``weight``, for each codec (see the module docstring).
INT8_PARTS = {"qweight": ("weight", "q"), "weight_scale": ("weight", "scale")}
INT4_PARTS = {
    "qweight": ("weight", "q4"),
    "weight_scale": ("weight", "scale"),
    "weight_zero": ("weight", "zero"),
}


class QuantizedWeight(nn.Module):
    """What every quantized layer shares: codec parts as buffers, the stage that made them, a kernel."""

    SCHEME: ClassVar[str]
    SLIM_PARTS: ClassVar[dict[str, tuple[str, str]]]
    KERNELS: ClassVar[tuple[str, ...]] = ()
    REFERENCE: ClassVar[str] = ""

    stage: dict[str, Any]
    kernel: str | None
    """A kernel forced by the user (None: the fastest measured here)."""
    # nn.Module's dicts allow None (``register_buffer(name, None)``); a quantized layer's never hold it:
    # each buffer is a codec part, each parameter a float tensor (a bias, an LSTM / GRU matrix kept
    # float). Declared so, the kernels read them straight from the dicts as tensors, with no check on the
    # call's path (``prepared_source`` reads each of them on every call).
    _buffers: dict[str, torch.Tensor]  # type: ignore[assignment]  # narrower than nn.Module's: see above
    _parameters: dict[str, nn.Parameter]  # type: ignore[assignment]  # likewise

    def _init_parts(self, parts: dict[str, torch.Tensor], stage: dict[str, Any]) -> None:
        for attr, (_, role) in self.SLIM_PARTS.items():
            self.register_buffer(attr, parts[role].contiguous())  # kernels and the writer read it flat
        self.stage = stage
        self._init_kernels()

    def _init_kernels(self) -> None:
        self.kernel = None
        # (kernel, variant) -> (what it was made from, packed state); kept for the kernels chosen here
        self._prepared: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._chosen: set[str] = set()
        self._copied: set[str] = set()
        """Kernels whose prepared state is their own copy of the codes (:meth:`packed`)."""
        self._timing = False
        """A kernel choice is timing the candidates (what they read in is given back as they go)."""
        # (batch bucket, dtype, device, threads, forced kernel) -> the chosen kernel's run (and what it
        # needs to know about its inputs), so that a call skips rebuilding the choice's key and candidates
        self._run_of: dict[tuple, Any] = {}
        self._compile_handle = kernels.compile_handle(self)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "weight" not in name or name.startswith("_"):
                raise
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute {name!r}: a quantized layer keeps its "
                "weight as codes (dequantized() gives the float tensor). Code outside the layer reads it: "
                "quantize with calibration inputs, which finds such layers and keeps them float, or skip it"
            ) from None

    @property
    def kind(self) -> str:
        """What the report calls this layer."""
        return type(self).__name__

    def coded_tensors(self) -> list[str]:
        """The names of the coded tensors these parts make: ``["weight"]``, one per matrix for an RNN."""
        return list(dict.fromkeys(tensor for tensor, _ in self.SLIM_PARTS.values()))

    def stage_of(self, tensor: str = "weight") -> dict[str, Any]:
        """The codec stage that made the parts of ``tensor``."""
        return self.stage

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype of the float weight these parts encode (what a slim reader decodes them to)."""
        return parse_dtype(self.stage_of(self.coded_tensors()[0])["dtype"])

    @property
    def codec(self) -> str:
        """The codec its weights are coded with (``int8``, ``int4``): what a writer or an exporter asks,
        whichever scheme made the layer (an embedding's class serves several)."""
        return self.stage_of(self.coded_tensors()[0])["codec"]

    @property
    def grouped(self) -> bool:
        """Its scales go per group of inputs (int4; int8 under a grouped scheme), not one per output row:
        a form an exporter whose int8 has a scale per channel cannot take as codes."""
        return "group_size" in self.stage_of(self.coded_tensors()[0])

    def parts(self, tensor: str = "weight") -> dict[str, torch.Tensor]:
        return {role: getattr(self, attr) for attr, (name, role) in self.SLIM_PARTS.items() if name == tensor}

    def encoded(self, tensor: str = "weight") -> Encoded:
        """A coded tensor as the slim writer stores it: its parts under the codec stage that made them."""
        return Encoded(self.parts(tensor), [dict(self.stage_of(tensor))])

    def dequantized(self, dtype: torch.dtype | None = None, tensor: str = "weight") -> torch.Tensor:
        """The float tensor the parts encode, in ``dtype`` (default: the original weight's dtype)."""
        stage = self.stage_of(tensor)
        codec = QUANTIZERS[stage["codec"]]
        parts = self.parts(tensor)
        primary = parts.pop(codec.primary)
        return codec.decode(
            primary, parts, {**stage, "dtype": dtype_name(dtype or parse_dtype(stage["dtype"]))}
        )

    def float_module(self) -> nn.Module:
        """The float layer these parts stand for (``nn.Linear``, ``nn.Embedding``, ``nn.Conv2d`` ...),
        holding the dequantized weight: what an exporter or a runtime without these kernels needs."""
        raise NotImplementedError

    def prepared(self, kernel: str, make: Callable[[], Any], variant: str = "") -> Any:
        """State ``kernel`` builds once from the buffers (a packed weight), rebuilt if the buffers change."""
        source = self.prepared_source()
        made = self._prepared.get((kernel, variant))
        if made is None or made[0] != source:
            made = self._prepared[kernel, variant] = (source, make())
        return made[1]

    def packed(self, kernel: str, make: Callable[[], Any]) -> Any:
        """:meth:`prepared` for a kernel's own copy of the codes (a packed weight, or a call holding one):
        once it is made, the
        codes' pages mapped from a file are given back, so that the layer holds one copy of its weight,
        not two (an int4 Llama loaded and generating held the file's codes and their packed copy: twice
        the file). A later read of the codes (``dequantized()``, a save) faults them in again from the
        page cache. Codes in memory, or written to since they were loaded, are left as they are."""

        def make_and_release() -> Any:
            state = make()
            # a call holding a packed weight, or an opaque tensor (oneDNN's packed weight), has no
            # storage to compare with the codes': always a copy
            opaque = not isinstance(state, torch.Tensor) or state.layout != torch.strided
            if opaque or state.untyped_storage().data_ptr() != self._codes().untyped_storage().data_ptr():
                self._copied.add(kernel)
                self._release_codes()
            pages.trim_heap()  # the packing's blocks, freed, stay in glibc's heap otherwise
            return state

        return self.prepared(kernel, make_and_release)

    def _codes(self) -> torch.Tensor:
        return self._buffers[next(iter(self.SLIM_PARTS))]

    def _release_codes(self) -> None:
        """Give back the pages mapped from a file of the codes and their scales (see :meth:`packed`; the
        fused kernels keep their scales in a layout of their own too); not parts written to since (those
        pages are this process's own: given back, the writes would be lost). A part a kernel still reads
        each call is read in again once."""
        pages.release_unwritten(self._prepared_from())

    def _giving_back(self) -> Callable[[torch.Tensor], Any] | None:
        """For a kernel that packs its copy of the codes a block at a time: what gives back the pages of
        a block of the codes once packed (None when the codes are not a mapping this process never
        wrote), so that the layer never holds two whole copies (a Llama's int4 head: 62 MiB)."""
        codes = self._codes()
        if codes.device.type != "cpu" or pages.written(codes) is not False:
            return None
        # no page of the codes is this process's own memory (written() read them all), so a block in a
        # range remembered as a file's is one still: the mappings need not be read again (6 ms a read)
        return lambda block: pages.release_pages([block])

    def prepared_source(self) -> tuple:
        """What :meth:`prepared` state was made from, to tell when it is stale: each buffer's address and
        version (inference-mode tensors have no version counter: their identity alone has to do)."""
        return tuple((t.data_ptr(), 0 if t.is_inference() else t._version) for t in self._prepared_from())

    def _prepared_from(self) -> list[torch.Tensor]:
        """The tensors packed state is made from: a change to any of them makes it again."""
        return [self._buffers[attr] for attr in self.SLIM_PARTS]  # not getattr: this runs on every call

    def _shape_key(self) -> tuple:
        """What, besides the batch, tells this layer's kernel timings apart from another's."""
        return tuple(self.stage["shape"]), self.stage.get("group_size")

    def run(
        self,
        x2d: torch.Tensor,
        candidates: dict[str, Callable[[], torch.Tensor]],
        tolerance: dict[str, float] | None = None,
    ) -> torch.Tensor:
        """Run the forced kernel, or the one measured fastest for this shape and batch size (see
        :meth:`choose`)."""
        return candidates[self.choose(x2d, x2d.shape[0], candidates, tolerance)]()

    def choose(
        self,
        x: torch.Tensor,
        rows: int,
        candidates: Mapping[str, Callable[[], torch.Tensor]],
        tolerance: dict[str, float] | None = None,
        truth: Callable[[], torch.Tensor] | None = None,
    ) -> str:
        """The forced kernel, or the one measured fastest for this shape and ``rows`` batch rows of ``x``
        (among those within ``tolerance``, relative L2, of the reference, or given the float product
        ``truth``, those :meth:`kernels.KernelChoice.best` admits by their error against it). A forced
        kernel that cannot run this input (a ``-bf16`` one on bfloat16 inputs, a fused one on a shape it
        does not take) gives way to its plain twin, else to the reference."""
        name = self.kernel
        if name is not None and name not in candidates:
            plain = name.removesuffix("-bf16")
            if plain not in candidates:
                _warn_once(
                    f"kernel {plain!r} does not run right here (on {x.device.type}, {x.dtype}); "
                    f"{type(self).__name__} layers run {self.REFERENCE!r} instead"
                )
            name = plain if plain in candidates else self.REFERENCE
        if name is None:
            key = (
                type(self).__name__,
                *self._shape_key(),
                kernels.batch_bucket(rows),
                x.dtype,
                x.device.type,
                torch.get_num_threads(),
            )
            timed = not CHOICES.known(key)
            if timed:
                pages.trim_heap()  # what the run so far left in glibc's heap, before timing adds to it
            self._timing = timed
            try:
                name = CHOICES.best(key, candidates, self.REFERENCE, tolerance or {}, truth)
            finally:
                self._timing = False
            # A kernel's state is keyed by its plain name: ``int4pack`` and ``int4pack-bf16`` share one
            # packed weight.
            # Timing a new batch size builds every candidate's state again, the losers' too (an LSTM's
            # float copy): whatever kernel won, what no chosen kernel uses is only memory.
            self._chosen.add(name.removesuffix("-bf16"))
            for unused in [k for k in self._prepared if k[0] not in self._chosen]:
                del self._prepared[unused]
            self._copied &= self._chosen  # a dropped copy no longer stands for the codes
            if timed and name.removesuffix("-bf16") in self._copied:
                self._release_codes()  # timing the float path read the codes in again
            if timed:
                pages.trim_heap()  # the candidates' blocks, freed, stay in glibc's heap otherwise
        return name

    def weight_only(
        self,
        x: torch.Tensor,
        plain: Callable[[torch.dtype], torch.Tensor],
        fused: tuple[str, Callable[[torch.dtype], torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """A weight-only product by the fastest of: ``plain(dtype)`` (the weight dequantized, then the
        float op) and ``fused`` (a kernel reading the codes), each in ``x``'s dtype and, for float32
        inputs on the CPU, in bfloat16 (``-bf16``): where the CPU multiplies bfloat16 natively that is
        several times faster, and its extra error, at most :data:`BF16_AGREEMENT` of the output (checked
        when it is chosen), stays below the weights' own rounding error."""
        dtypes = {"": x.dtype}
        if x.dtype == torch.float32 and x.device.type == "cpu":
            dtypes["-bf16"] = torch.bfloat16
        candidates: dict[str, Callable[[], torch.Tensor]] = {}
        for suffix, dtype in dtypes.items():
            candidates["dequantize" + suffix] = partial(plain, dtype)
            if fused is not None:
                candidates[fused[0] + suffix] = partial(fused[1], dtype)
        half = x.dtype in (torch.bfloat16, torch.float16)  # products that round like bfloat16 ones
        tolerance = {name: BF16_AGREEMENT for name in candidates if half or name.endswith("-bf16")}
        return self.run(x, candidates, tolerance)

    def __getstate__(self) -> dict[str, Any]:
        # Packed weights are a cache (and oneDNN's cannot be copied): copies rebuild them on first use.
        state = self.__dict__.copy()
        state["_prepared"], state["_chosen"], state["_copied"], state["_run_of"] = {}, set(), set(), {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._compile_handle = kernels.compile_handle(self)  # a copy is another layer to a compiled graph

    def compiled_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Under ``torch.compile``: :meth:`eager_forward` as one operator, its output shaped by
        :meth:`fake_forward` while tracing."""
        with torch.no_grad():  # as in eager: no gradient flows through quantized codes
            return kernels.quantized_layer(x, self._compile_handle)

    def eager_forward(self, *args: Any) -> Any:
        """The forward a compiled graph's operator runs (:class:`kernels.CompiledLayer`): ``(x) -> output``
        for a Linear or a convolution (``slimtorch::quantized_layer``), ``(input, hx) -> [output, *state]``
        for an LSTM / GRU (``slimtorch::quantized_rnn``); each kind declares its own."""
        raise NotImplementedError

    def fake_forward(self, *args: Any) -> Any:
        """:meth:`eager_forward`'s outputs as empty tensors of their shapes, for tracing."""
        raise NotImplementedError


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


CODES_OF = {"onednn": "uint8", "onednn-u7": "uint7", "int_mm": "int8", "reference": "uint8"}
"""The activation codes each int8-dynamic kernel takes (see :func:`kernels.quantize_rows`)."""
ZERO_POINTS = {"onednn": 128, "onednn-u7": 0}
PACKED = frozenset({"onednn", "onednn-u7"})
"""The int8-dynamic kernels that pack the weight on their first call. The others are not run before they
are timed: ``torch._int_mm`` took 1 s a call on 2048 rows of a 384x1536 layer on an AVX2 EPYC, and running
it once on each copy of the layer made MiniLM's first batch of 16 take 46 s."""
ROTATION_BYTES = 8 << 20
"""Weight bytes an int8-dynamic kernel choice turns over (:meth:`Int8DynamicLinear._chosen_run`). In a
model the other layers' weights pass through a core's caches between two calls of one layer, and the
kernels do not suffer that alike (``benchmarks/int8_latency.py --turns``): on 12 distinct 768x3072
layers called in turn at 128 rows, ``torch._int_mm`` (which rearranges the weight on each call) took 859
us a call against 735 on one layer called again and again; oneDNN's packed weight 709 against 677;
768x768: 232 against 196, and 220 against 211. Timed on one weight, BERT-base's
768-wide layers at batch 1 went to ``_int_mm`` by 1-2%, and the forward ran 1.09x onnxruntime int8's
time eager, 1.06x compiled (``benchmarks/int8_latency.py``); timed in turns they go to oneDNN by 9-15%:
1.01x and 0.96x. 8 MiB: several times the L2 of a server core."""
PRODUCT_BLOCK = 2 << 20
"""Weight values a weight-only layer's float path dequantizes at a time (8 MiB in float32; its decoding's
temporaries a few times that): a Llama-2-7B MLP matrix (45M values) in 22 blocks, its head (131M) in 63.
Small, for the largest layer's blocks are part of a loaded model's peak while its kernels are timed; the
first token of an int4 Llama from a 4.17 GB file took 11.1 s with blocks of 2M, 11.3 s with 16M."""
MAX_TWINS = 15
"""At most this many copies of a small layer in that turn (16 layers of 384x384: 2.3 MB)."""


# -- Linear ----------------------------------------------------------------------------------------------
class _QuantizedLinear(QuantizedWeight):
    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, encoded: Encoded):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._init_parts(encoded.parts, encoded.stages[0])

    def extra_repr(self) -> str:
        group = f", group_size={self.stage['group_size']}" if "group_size" in self.stage else ""
        return f"in_features={self.in_features}, out_features={self.out_features}{group}"

    def float_module(self) -> nn.Linear:
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(self.dequantized(), requires_grad=False)
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.detach().clone(), requires_grad=False)
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting():
            # An exported program keeps the codes and dequantizes them in its graph; the kernels chosen
            # by timing are Python, which export cannot trace.
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.dequantized(x.dtype), bias)
        if torch.compiler.is_compiling():
            return self.compiled_forward(x)
        return self.eager_forward(x)

    def eager_forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # inference only: int8 codes have no gradient
            out = self._matmul(x, x.reshape(-1, self.in_features))
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def fake_forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], self.out_features)

    def _matmul(self, x: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int8DynamicLinear(_QuantizedLinear):
    """``nn.Linear`` with int8 weights (one scale per output channel) and int8 activations quantized per
    row on each call; the product is exact in int32. The fastest kernel that is right on this machine is
    chosen (7-bit asymmetric row codes where oneDNN's 8-bit product saturates: CPUs without VNNI).

    Each call costs a dozen small tensor operations around the int8 product, so at small batches the
    Python around them counts too: once a batch size has its kernel, a call goes straight to it. (The
    layer keeps that kernel after ``CHOICES.clear()``.)
    """

    SCHEME = "int8-dynamic"
    SLIM_PARTS = INT8_PARTS
    KERNELS = ("onednn", "onednn-u7", "int_mm", "reference")  # their codes: CODES_OF
    REFERENCE = "reference"
    SHARES_INPUT_CODES = True
    """Its input's codes can serve a sibling reading the same input (:mod:`slimtorch.quant.sharing`)."""

    def _init_kernels(self) -> None:
        super()._init_kernels()
        rowcodes.prepare()  # numba compiles the row quantization here, not in the first timed forward

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        rowcodes.prepare()  # an unpickled layer may be the first of its process

    def eager_forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)
        if torch.is_grad_enabled():  # entering no_grad costs more than asking, and inference never needs it
            with torch.no_grad():  # int8 codes have no gradient
                out = self._matmul(x, x2d)
        else:
            out = self._matmul(x, x2d)
        out = out.view(*x.shape[:-1], self.out_features)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def compiled_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Under ``torch.compile``: where the graph's batch size is fixed, the layer is traced with the
        kernel chosen for that size (chosen while tracing, on random rows, if no call chose it yet): its
        rows quantized by one operator (``slimtorch::quantize_rows``), the product ``torch._int_mm`` or
        oneDNN's (``slimtorch::onednn_product``), the scaling and the bias left to inductor, which fuses
        them into what follows. Otherwise (a batch size the graph leaves dynamic, the reference kernel)
        one operator runs :meth:`eager_forward`, which chooses per call.

        On all-MiniLM-L6-v2 at batch 1 (``benchmarks/int8_latency.py``): 7.8 ms a forward against 8.5
        with every layer one operator (the Python around each call, and a pass over its output, gone)."""
        from torch.fx.experimental.symbolic_shapes import statically_known_true  # imported when compiling

        rows = x.numel() // self.in_features
        if self.kernel not in (None, *TRACED_KERNELS) or not statically_known_true(rows < 1 << 62):
            # the forced kernel is read here, not in the helper, so that the graph is guarded on it;
            # a symbolic (dynamic) batch is not statically known to be anything
            return super().compiled_forward(x)
        kernel = _traced_kernel(self._compile_handle, rows, x.dtype, x.device)
        if kernel not in TRACED_KERNELS:
            return super().compiled_forward(x)
        with torch.no_grad():
            x2d = x.reshape(-1, self.in_features)
            codes, row_scale = sharing.traced_codes(x, x2d, CODES_OF[kernel])
            if kernel == "int_mm":
                product = torch._int_mm(codes, self._buffers["qweight"].t()) * self._buffers["weight_scale"]
            else:
                product = kernels.onednn_product_op(codes, self._compile_handle, ZERO_POINTS[kernel])
            out = product * row_scale
            if self.bias is not None:
                out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def onednn_product(self, codes: torch.Tensor, zero_point: int = 128) -> torch.Tensor:
        """oneDNN's product of +128 (or +64: ``zero_point``) codes and the weight, scaled per output
        channel (not yet per row)."""
        packed = self.packed("onednn", self._onednn_pack)
        return kernels.onednn_product(codes, packed, self._buffers["weight_scale"], zero_point)

    def _matmul(self, x: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
        rows = x2d.shape[0]
        known = self._known(rows, x2d.dtype, x2d.device)
        chosen = self._run_of.get(known)
        if chosen is None:
            chosen = self._run_of[known] = self._chosen_run(x2d, rows)
        run, codes, name = chosen
        call = sharing.current_call()
        if call is not None:  # inside a sharing parent: this layer's part of its group's joint product
            joint = call.output(self, x, x2d, known, name)
            if joint is not None:
                return joint
        values, row_scale = kernels.SHARED_INPUTS.codes(x, x2d, codes)
        return run(values, row_scale)

    @staticmethod
    def joint_run(layers: tuple[Int8DynamicLinear, ...], kernel: str) -> sharing.JointRun | None:
        """One run for several layers reading one input (:class:`sharing.Siblings`), on ``kernel``:
        their weights packed side by side, one product, each layer's output split off in the epilogue;
        ``None`` for a kernel that does not run jointly (those that do not pack: :data:`PACKED`). The
        layers' own packed weights are let go (made again if one runs alone)."""
        if kernel not in PACKED:
            return None
        qweight = torch.cat([layer._buffers["qweight"] for layer in layers])
        scale = torch.cat([layer._buffers["weight_scale"] for layer in layers])
        widths = [layer.out_features for layer in layers]
        bias = None
        if any(layer.bias is not None for layer in layers):
            bias = torch.cat(
                [
                    torch.zeros(layer.out_features) if layer.bias is None else layer.bias.detach().float()
                    for layer in layers
                ]
            )
        codes, zero_point = CODES_OF[kernel], ZERO_POINTS[kernel]
        sums = _scaled_weight_sums(qweight, scale) if codes in rowcodes.ASYMMETRIC else None
        split = kernels.split_epilogue(codes, sums, bias, widths)
        product = kernels.onednn_runner(kernels.onednn_pack(qweight), scale, zero_point, split)
        for layer in layers:
            layer._prepared.pop((kernel, ""), None)

        def run(x: torch.Tensor, x2d: torch.Tensor) -> list[torch.Tensor]:
            return product(*kernels.SHARED_INPUTS.codes(x, x2d, codes))

        return run

    def _known(self, rows: int, dtype: torch.dtype, device: torch.device) -> tuple:
        """The kernel choice's own key, less what never changes for this layer (its shape)."""
        return ((rows - 1).bit_length(), dtype, device, torch.get_num_threads(), self.kernel)

    def kernel_at(self, rows: int, dtype: torch.dtype, device: torch.device) -> str:
        """The name of this layer's kernel for ``rows`` rows of ``dtype`` on ``device``; a batch size no
        call has met yet is timed now, on random rows."""
        known = self._known(rows, dtype, device)
        if known not in self._run_of:
            generator = torch.Generator(device).manual_seed(0)  # the caller's random stream is not touched
            x2d = torch.randn(rows, self.in_features, device=device, generator=generator).to(dtype)
            self._run_of[known] = self._chosen_run(x2d, rows)
        return self._run_of[known][2]

    def _chosen_run(self, x2d: torch.Tensor, rows: int) -> tuple[Callable, str, str]:
        """The kernel to run for this batch size, the codes it takes (:data:`CODES_OF`) and its name; each
        candidate is timed on the codes it takes, as its calls will get them, and on weights out of the
        caches, as a model's layers find them: in turns over this layer and copies of it (:meth:`_twins`).
        A kernel is admitted by its error against the float product of these rows (the dequantized
        weight's), at most :data:`kernels.ACCURACY_FACTOR` times the reference's."""
        runs = self._runs(x2d.device)
        made = {codes: kernels.quantize_rows(x2d, codes) for codes in {CODES_OF[n] for n in runs}}
        inputs = {name: made[CODES_OF[name]] for name in runs}
        twins = functools.cache(lambda: self._twins(x2d.device, inputs))

        def calls(name: str) -> list[Callable[[], torch.Tensor]]:
            layers = [self] if name == self.REFERENCE else [self, *twins()]
            return [partial(layer._runs(x2d.device)[name], *inputs[name]) for layer in layers]

        def truth() -> torch.Tensor:
            return F.linear(x2d.float(), self.dequantized(torch.float32), self.bias)

        candidates = {name: kernels.in_turn(partial(calls, name)) for name in runs}
        name = self.choose(x2d, rows, candidates, truth=truth)
        return runs[name], CODES_OF[name], name

    def _twins(
        self, device: torch.device, inputs: dict[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> list[Int8DynamicLinear]:
        """Copies of this layer, each with a weight of its own, enough that the weights of one turn over
        them and this layer come to :data:`ROTATION_BYTES`; each kernel that packs its weight (:data:`PACKED`)
        has run once on each, so that it packs then, not in a timed call."""
        count = min(MAX_TWINS, -(-ROTATION_BYTES // max(self._buffers["qweight"].nbytes, 1)) - 1)
        encoded = self.encoded()
        twins = []
        for _ in range(count):
            parts = {role: part.clone() for role, part in encoded.parts.items()}
            twin = type(self)(self.in_features, self.out_features, self.bias, Encoded(parts, encoded.stages))
            for name, run in twin._runs(device).items():
                if name in PACKED:  # packs its weight now, not in a timed call; the others have none
                    run(*inputs[name])
            twins.append(twin)
        return twins

    def _runs(self, device: torch.device) -> dict[str, Callable[[torch.Tensor, Any], torch.Tensor]]:
        """The kernels that run on ``device`` (:func:`int8_dynamic_kernels`), each from its input
        (:data:`CODES_OF`: codes and row scales, or the float rows) to the output."""
        every = {
            "reference": self._reference,
            "int_mm": self._int_mm,
            "onednn": self._onednn,
            "onednn-u7": self._onednn_u7,
        }
        return {name: every[name] for name in int8_dynamic_kernels(device)}

    def _reference(self, codes: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
        q, scale = self._buffers["qweight"], self._buffers["weight_scale"]
        return kernels.reference_int8_linear(codes, row_scale, q, scale, self.bias)

    def _int_mm(self, codes: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
        q, scale = self._buffers["qweight"], self._buffers["weight_scale"]
        return kernels.int_mm_int8_linear(codes, row_scale, q, scale, self.bias)

    def _onednn(self, codes: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
        return kernels.scale_back(self.onednn_product(codes), row_scale, self.bias)

    def _onednn_u7(self, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        return self.packed("onednn-u7", self._onednn_u7_state)(codes, params)

    def _onednn_u7_state(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The product on the packed weight and the epilogue that takes each ``uint7`` row's zero point
        off, with the weight's scaled row sums, as one call (one state, one freshness check a call)."""
        q, scale = self._buffers["qweight"], self._buffers["weight_scale"]
        shift = kernels.shift_epilogue(_scaled_weight_sums(q, scale), self.bias)
        return kernels.onednn_runner(kernels.onednn_pack(q), scale, ZERO_POINTS["onednn-u7"], shift)

    def _onednn_pack(self) -> torch.Tensor:
        return kernels.onednn_pack(self._buffers["qweight"])

    def _prepared_from(self) -> list[torch.Tensor]:
        # the packed weights, and onednn-u7's epilogue (the weight's scaled row sums, the bias); oneDNN reads
        # the scales on each call
        return [self._buffers["qweight"], self._buffers["weight_scale"], *self._parameters.values()]


def _scaled_weight_sums(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each output channel's weight codes summed, times its scale: what ``uint7`` rows' zero points
    take off the product (:func:`kernels.shift_back`)."""
    return qweight.sum(dim=1, dtype=torch.int32).float().mul_(scale)


def int8_dynamic_kernels(device: torch.device) -> tuple[str, ...]:
    """The int8-dynamic kernels that run, and run right, on ``device`` in this process. oneDNN's 8-bit
    product is left out where it saturates (:func:`kernels.onednn_exact`: CPUs without VNNI), its 7-bit
    one where even that is not exact. torch.ao's fbgemm kernel is not a candidate: its codes are per
    tensor, so a batch it was admitted on says little of the next (on all-MiniLM-L6-v2 it won the 384-wide
    layers on the first batch and took the worst sentence cosine from 0.989 to 0.982); it is the
    benchmark's peer instead (``benchmarks/int8_latency.py``)."""
    names = ["reference", "int_mm"]
    if device.type == "cpu":
        names += [name for name in ZERO_POINTS if kernels.onednn_exact(CODES_OF[name])]
    return tuple(names)


TRACED_KERNELS = ("int_mm", "onednn")  # onednn-u7's rows carry zero points: one operator, eager
"""The int8-dynamic kernels a compiled graph calls itself (:meth:`Int8DynamicLinear.compiled_forward`)."""


def constant_when_compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.assume_constant_result(fn)`` without importing dynamo, which that does (1.1 s of
    every fresh process loading a quantized model, compiled or not): the same mark on ``fn``, which dynamo
    reads when it traces a call (a test holds it to torch's own)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@constant_when_compiled
def _traced_kernel(handle: int, rows: int, dtype: torch.dtype, device: torch.device) -> str:
    """:meth:`Int8DynamicLinear.kernel_at` of the layer ``handle`` names, answered while dynamo traces
    (it calls this for real, and its answer is a constant of the graph)."""
    with torch.no_grad():
        return kernels.compiled_layer(handle).kernel_at(rows, dtype, device)


class _WeightOnlyLinear(_QuantizedLinear):
    """Weight-only layers: float activations times dequantized weights (see :meth:`weight_only`)."""

    REFERENCE = "dequantize"
    FUSED: ClassVar[str]

    def _matmul(self, x: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x2d.dtype)

        def plain(dtype: torch.dtype) -> torch.Tensor:
            return _plus(self._dequantized_product(x2d.to(dtype), dtype).to(x2d.dtype), bias)

        def fused(dtype: torch.dtype) -> torch.Tensor:
            return _plus(self._fused(kernels.aligned(x2d.to(dtype)), dtype).to(x2d.dtype), bias)

        usable = x2d.device.type == "cpu" and self._fused_fits()
        return self.weight_only(x2d, plain, (self.FUSED, fused) if usable else None)

    def _dequantized_product(self, x2d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x2d`` times the weight dequantized to ``dtype``; a weight of over :data:`PRODUCT_BLOCK`
        values a block of output channels at a time, so that the float copy made for the product is one
        block's (a Llama's 32000x4096 int4 head dequantized whole took 512 MiB in float32 per call), and,
        where a packed copy of the codes was made (:meth:`packed`), so that the codes' mapped pages read
        in again are one block's (timing this path beside the packed kernel read the head's 62 MiB back)."""
        if self.out_features * self.in_features <= PRODUCT_BLOCK:
            return F.linear(x2d, self.dequantized(dtype))
        out = torch.empty(x2d.shape[0], self.out_features, dtype=dtype, device=x2d.device)
        shape = (self.out_features, self.in_features)
        stage = {**self.stage, "dtype": dtype_name(dtype)}
        # with a kernel's copy of the codes made (or while the kernels are timed, one of which may make
        # it), their mapped pages stay given back: a block's, once used
        give_back = self._giving_back() if self._copied or self._timing else None
        codes = self._codes()
        for rows, weight in decoded_blocks(self.parts(), [stage], dtype, shape, PRODUCT_BLOCK):
            out[:, rows] = F.linear(x2d, weight)
            if give_back is not None:
                give_back(codes[rows])
        return out

    def _fused_fits(self) -> bool:
        return True

    def _fused(self, x2d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError


class Int8WeightLinear(_WeightOnlyLinear):
    """``nn.Linear`` with int8 weights (one scale per output channel) and float activations."""

    SCHEME = "int8-weight"
    SLIM_PARTS = INT8_PARTS
    KERNELS = ("dequantize", "int8pack", "dequantize-bf16", "int8pack-bf16")
    FUSED = "int8pack"

    def _fused_fits(self) -> bool:
        # torch's bfloat16 _weight_int8pack_mm crashes the process (SIGSEGV, torch 2.x CPU) when the inner
        # size is not a multiple of 16: a channel-pruned classifier with 24 inputs once did
        return self.in_features % 16 == 0

    def _fused(self, x2d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        scale = self.prepared("int8pack", lambda: self.weight_scale.to(dtype), variant=str(dtype))
        weight = self.packed("int8pack", lambda: kernels.aligned(self.qweight))
        return torch._weight_int8pack_mm(x2d, weight, scale)


class Int8GroupWeightLinear(_WeightOnlyLinear):
    """``nn.Linear`` with int8 weights, a scale per group of ``group_size`` inputs of each output channel
    (an outlier costs its group's precision, not its row's), and float activations. torch has no packed
    kernel for grouped int8: the product dequantizes a block of rows at a time, in float32 or bfloat16."""

    SCHEME = "int8-group-weight"
    SLIM_PARTS = INT8_PARTS
    KERNELS = ("dequantize", "dequantize-bf16")
    FUSED = ""

    def _fused_fits(self) -> bool:
        return False


class Int4WeightLinear(_WeightOnlyLinear):
    """``nn.Linear`` with 4-bit weights, a scale and a zero point per group of ``group_size`` inputs of each
    output channel, and float activations."""

    SCHEME = "int4-weight"
    SLIM_PARTS = INT4_PARTS
    KERNELS = ("dequantize", "int4pack", "dequantize-bf16", "int4pack-bf16")
    FUSED = "int4pack"

    def _fused_fits(self) -> bool:
        return self.in_features % self.stage["group_size"] == 0

    def _fused(self, x2d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        scales = self.prepared(  # before the packed codes, whose making gives back the parts' pages
            "int4pack",
            lambda: kernels.int4pack_scales(self.weight_scale, self.weight_zero, dtype),
            variant=str(dtype),
        )
        packed = self.packed(
            "int4pack",
            lambda: kernels.int4pack_weight(self.qweight, self.in_features, packed=self._giving_back()),
        )
        return torch._weight_int4pack_mm_for_cpu(x2d, packed, self.stage["group_size"], scales)


def _plus(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out.add_(bias)


# -- Embedding ------------------------------------------------------------------------------------------
class _QuantizedEmbedding(QuantizedWeight):
    ROWS_LOOKED_UP: ClassVar[bool] = True
    """A forward reads only the rows it looks up: a load gives back the rest's mapped pages
    (:func:`slimtorch.loading.loader.lookup_tables`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None, encoded: Encoded):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self._init_parts(encoded.parts, encoded.stages[0])

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"

    def float_module(self) -> nn.Embedding:
        weight = self.dequantized()
        size = (self.num_embeddings, self.embedding_dim)
        return nn.Embedding(*size, self.padding_idx, _weight=weight, _freeze=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting():
            return self._rows(ids.reshape(-1)).reshape(*ids.shape, self.embedding_dim)
        with torch.no_grad():
            return self._rows(ids.reshape(-1)).reshape(*ids.shape, self.embedding_dim)


class Int8Embedding(_QuantizedEmbedding):
    """``nn.Embedding`` with int8 rows, a scale each (or one per group of a row's values: the class serves
    every int8 scheme); only the rows looked up are dequantized."""

    SCHEME = "int8"
    SLIM_PARTS = INT8_PARTS

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if "group_size" in self.stage:
            stage = {**self.stage, "shape": [ids.numel(), self.embedding_dim]}
            scale = {"scale": self.weight_scale.index_select(0, ids)}
            return INT8.decode(self.qweight.index_select(0, ids), scale, stage)
        # index_select, not qweight[ids]: advanced indexing of int8 rows is ten times slower
        rows = self.qweight.index_select(0, ids).to(self.weight_dtype)
        return rows.mul_(self.weight_scale.index_select(0, ids).to(self.weight_dtype).unsqueeze(1))


class Int4Embedding(_QuantizedEmbedding):
    """``nn.Embedding`` with 4-bit rows in groups; only the rows looked up are dequantized."""

    SCHEME = "int4"
    SLIM_PARTS = INT4_PARTS

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        stage = {**self.stage, "shape": [ids.numel(), self.embedding_dim]}
        parts = {
            "scale": self.weight_scale.index_select(0, ids),
            "zero": self.weight_zero.index_select(0, ids),
        }
        return INT4.decode(self.qweight.index_select(0, ids), parts, stage)
