"""A dry run of the sequence split on the traced copy: does the model's own code between
its blocks work on a piece of the sequence?

Sequence and context parallel split the residual stream along the sequence around each
block (``sequence_layout.py``): the code of a decoder layer outside its blocks, and the
code after the layers up to the output head, runs on each rank's piece. That is exact for
per-token code only. A token shift (``F.pad`` of the stream along the sequence), a
convolution or a cumulative sum over the stream, or a reshape to the full sequence length
(GPT-2's ``hidden_states.view(output_shape)`` after its final norm) is not — and the
planner cannot tell them from module structure.

So the tiny copy runs once per piece, as one rank would: the first layer's stream input
is cut to the piece; each block that gathers the stream (attention, and under sequence
parallel without cp every block) gets the whole sequence — the unsplit model's, with this
piece's own values in place, as an all-gather would give it — and hands on its output's
piece; the head gathers its input. At every gather the piece must equal the unsplit
model's slice: a difference names the stretch of code that is not per-token. An error
raised on a piece names the line. When only the code after the layers fails, the run is
repeated with the stream made whole where it leaves the layers (each module reading the
layers' output gathers it, ``Dataflow.layer_readers``); if that passes, the plan does the
same (``whole_after_layers``). When the layers fail on other inputs they take per token,
made on the whole sequence before them (Gemma 4's per-layer embeddings), the run is
repeated with those cut to the piece at every layer; if that passes, the plan cuts them
too (``split_layer_inputs``).
"""

import contextlib
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from hyper_parallel.distributed.model_parts import decoder_layers, locate_input, output_embeddings, positional_names
from hyper_parallel.errors import HyperParallelError

PIECES = 2  # a token shift shows at the boundary of two pieces; a full-length reshape on any
# Attention blocks by the names of their modules or by the roles of their members.
ATTENTION_LEAVES = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "q_norm", "k_norm"})
ATTENTION_ROLES = frozenset({"head_norm", "projection_norm", "fused_qkv"})


@dataclass(frozen=True)
class SequenceSplitCheck:
    """The dry run's verdict: ``error`` says why the stream cannot be split ("" when it can);
    ``whole_after_layers``: it can when the stream is made whole where it leaves the layers."""

    error: str = ""
    whole_after_layers: bool = False
    split_layer_inputs: tuple[int, ...] = ()


@dataclass
class _Points:
    """Where the plan converts the stream, in the traced copy's module names."""

    split: str  # the first decoder layer: its stream input (position 0) is cut to the piece
    layers: tuple[str, ...]
    split_inputs: tuple[int, ...] = ()  # other inputs of every layer cut to the piece (per-layer inputs)
    gathered: dict[str, tuple[int, ...]] = field(default_factory=dict)  # module -> stream input positions
    sliced: dict[str, tuple[int, ...]] = field(default_factory=dict)  # module -> stream outputs cut to the piece


class Unusable(HyperParallelError):
    """The unsplit copy does not run, or computes non-finite values, so nothing compares."""


class _Divergence(HyperParallelError):
    def __init__(self, text: str, after_layers: bool):
        super().__init__(text)
        self.text, self.after_layers = text, after_layers


def is_attention(fqn: str, block: nn.Module, roles: dict[str, str], attention_inputs: frozenset[str]) -> bool:
    """A block holding q/k/v projections or per-head norms (by name, by role, or seen
    feeding attention in the traced forward). The sequence layout gathers such a block,
    and this dry run does the same for the blocks of the traced copy."""
    return any(name.rpartition(".")[2] in ATTENTION_LEAVES or roles.get(f"{fqn}.{name}") in ATTENTION_ROLES
               or f"{fqn}.{name}" in attention_inputs for name, _ in block.named_modules() if name)


def whole_over_cp(fqn: str, block: nn.Module, read_outside: frozenset[str]) -> bool:
    """A block (not attention) that context parallel still gathers: the model's code uses
    parameters of its modules outside their forward (DBRX's experts slice their GLU's
    matrices), so they stay plain tensors, whose gradients only whole-sequence work makes
    whole. The sequence layout and this dry run both ask this."""
    return any((f"{fqn}.{name}" if name else fqn) in read_outside for name, _ in block.named_modules())


def check_sequence_split(model: nn.Module, input_ids: torch.Tensor, flow, *, cp: bool) -> SequenceSplitCheck:
    """Run the dry run (module docstring) for a recipe with context parallel (``cp``: blocks
    other than attention keep their tokens split) or sequence parallel alone."""
    points = _points(model, flow, cp=cp, whole_after_layers=False)
    if points is None:
        return SequenceSplitCheck()  # no decoder layers: the sequence layout refuses the model itself
    try:
        try:
            with perturbed(model):
                return _verdict(model, input_ids, flow, points, cp=cp)
        except Unusable:  # the perturbed copy does not run (or computes inf/nan): its own weights
            return _verdict(model, input_ids, flow, points, cp=cp)
    except Exception as exc:  # nothing checked is nothing claimed: the split is refused with why
        return SequenceSplitCheck(error=f"the unsplit tiny copy did not run through the dry run: "
                                        f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}")


@contextlib.contextmanager
def perturbed(model: nn.Module) -> Iterator[None]:
    """The copy's parameters and float buffers with a little noise while the dry run runs:
    a path that starts at zero (a token shift behind a zero-initialized gate, or a mixing
    buffer a checkpoint sets) mixes tokens once training moves the gate or the checkpoint
    loads, but not in a forward of freshly initialized weights."""
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    saved = [tensor.detach().clone() for tensor in tensors]
    generator = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            for tensor in tensors:
                tensor.add_(0.02 * torch.randn(tensor.shape, generator=generator).to(tensor.dtype))
        yield
    finally:
        with torch.no_grad():
            for tensor, value in zip(tensors, saved):
                tensor.copy_(value)


def _verdict(model: nn.Module, input_ids: torch.Tensor, flow, points: "_Points", *, cp: bool) -> SequenceSplitCheck:
    failure = _first_divergence(model, input_ids, points)
    if failure is not None and not failure.after_layers:
        # Inputs the layers take besides the stream, made on the whole sequence before them
        # (Gemma 4's per-layer embeddings): the layer's own code may combine them with its
        # piece, so they are cut to the piece as well, if that makes the run agree.
        candidates = _sequence_layer_inputs(model, input_ids, points)
        if candidates:
            split = _Points(**{**vars(points), "split_inputs": candidates})
            second = _first_divergence(model, input_ids, split)
            if second is None or second.after_layers:
                points, failure = split, second
    split_inputs = points.split_inputs
    if failure is None:
        return SequenceSplitCheck(split_layer_inputs=split_inputs)
    if failure.after_layers:
        whole = _points(model, flow, cp=cp, whole_after_layers=True)
        whole.split_inputs = split_inputs
        second = _first_divergence(model, input_ids, whole)
        if second is None:
            return SequenceSplitCheck(whole_after_layers=True, split_layer_inputs=split_inputs)
        return SequenceSplitCheck(error=f"{second.text} (also with the stream made whole where it leaves the "
                                        f"decoder layers)")
    return SequenceSplitCheck(error=failure.text)


def _sequence_layer_inputs(model: nn.Module, input_ids: torch.Tensor, points: "_Points") -> tuple[int, ...]:
    """Positions of the first layer's inputs other than the stream that hold a float value
    per token ([batch, sequence, ...], 3 dims or more): candidates to cut to the piece.
    (Masks are [batch, 1, sequence, sequence]; position ids and the rotary tables, which
    attention reads on the whole sequence, are 2-d or passed in a tuple.)"""
    first = dict(model.named_modules())[points.split]
    names = positional_names(first)
    found: list[int] = []

    def hook(module, args, kwargs):
        for position in range(1, len(names)):
            where, key = locate_input(position, list(args), dict(kwargs), names)
            value = None if where is None else where[key]
            if (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 3
                    and value.shape[1] == input_ids.shape[1]):
                found.append(position)

    handle = first.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        _forward(model, input_ids)
    finally:
        handle.remove()
    return tuple(dict.fromkeys(found))


def _points(model: nn.Module, flow, *, cp: bool, whole_after_layers: bool) -> _Points | None:
    """The plan's conversions of the stream, as ``sequence_layout`` places them: attention
    blocks gather and slice; other blocks too under sequence parallel alone (under cp their
    tokens stay split); a layer's own projection (OPT's fc1) gathers when it reads the stream
    and slices when it writes it, under sequence parallel alone; the head gathers."""
    found = decoder_layers(model)
    if found is None:
        return None
    layers_fqn, layers = found
    points = _Points(split=f"{layers_fqn}.0", layers=tuple(f"{layers_fqn}.{i}" for i in range(len(layers))))
    flow_roles = flow.roles()
    for index, layer in enumerate(layers):
        for name, child in layer.named_children():
            fqn = f"{layers_fqn}.{index}.{name}"
            if not any(True for _ in child.parameters()):
                continue
            leaf = not any(any(True for _ in c.parameters()) for c in child.children())
            block = flow.block_of(fqn)
            attention = is_attention(fqn, child, flow_roles, flow.attention_inputs)
            streams = flow.value_inputs.get(fqn) or (0,)
            if leaf and block is not None and not block.whole:  # a projection of the layer itself
                if not cp and fqn in block.consumers:
                    points.sliced[fqn] = (0,)
                elif not cp:
                    points.gathered[fqn] = (0,)
            elif attention or not cp and not leaf or cp and whole_over_cp(fqn, child, flow.read_outside):
                points.gathered[fqn] = streams
                points.sliced[fqn] = flow.value_outputs.get(fqn) or (0,)
    head = output_embeddings(model)
    names = {id(module): name for name, module in model.named_modules()}
    head_name = names.get(id(head))
    readers = flow.layer_readers if whole_after_layers else frozenset()
    for name in readers:
        points.gathered[name] = (0,)
    if head_name is not None and (not whole_after_layers or head_name in readers):
        points.gathered[head_name] = (0,)
    return points


def _first_divergence(model: nn.Module, input_ids: torch.Tensor, points: _Points) -> _Divergence | None:
    reference, layer_calls = _reference_inputs(model, input_ids, points)
    for piece in range(PIECES):
        run = _PieceRun(model, points, reference, piece, input_ids.shape[1], layer_calls)
        try:
            run.forward(input_ids)
        except _Divergence as divergence:
            return divergence
    return None


def _reference_inputs(model: nn.Module, input_ids: torch.Tensor, points: _Points) -> tuple[dict, int]:
    """(module, call) -> the unsplit model's stream inputs at every gather point; and how
    many decoder layer calls the forward made."""
    seen: dict[tuple[str, int], dict[int, torch.Tensor]] = {}
    calls: dict[str, int] = {}
    layer_calls = []
    modules = dict(model.named_modules())

    def record(name, positions):
        arg_names = positional_names(modules[name])

        def hook(module, args, kwargs):
            call = calls[name] = calls.get(name, -1) + 1
            entry = seen.setdefault((name, call), {})
            for position in positions:
                where, key = locate_input(position, list(args), dict(kwargs), arg_names)
                if where is not None and isinstance(where[key], torch.Tensor):
                    entry[position] = where[key].detach().clone()
        return hook

    handles = [modules[name].register_forward_pre_hook(record(name, positions), with_kwargs=True)
               for name, positions in points.gathered.items()]
    handles += [modules[name].register_forward_hook(lambda *_: layer_calls.append(1)) for name in points.layers]
    try:
        _forward(model, input_ids)
    except Exception as exc:
        raise Unusable(f"{type(exc).__name__}: {exc}") from exc
    finally:
        for handle in handles:
            handle.remove()
    if not all(torch.isfinite(value).all() for entry in seen.values() for value in entry.values()
               if value.is_floating_point()):
        raise Unusable("non-finite values")
    return seen, len(layer_calls)


def _forward(model: nn.Module, input_ids: torch.Tensor) -> None:
    """One forward as the trace ran it (training mode, no gradients), from the same seed:
    every run draws the same random numbers."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        torch.random.set_rng_state(state)


class _PieceRun:
    """One forward as the rank holding ``piece`` of the sequence sees it."""

    def __init__(self, model: nn.Module, points: _Points, reference: dict, piece: int, seq_len: int,
                 layer_calls: int):
        self.model, self.points, self.reference = model, points, reference
        self.piece, self.seq_len = piece, seq_len
        self.modules = dict(model.named_modules())
        self.calls: dict[str, int] = {}
        self.depth = 0  # decoder layers running
        self.layer_calls, self.all_layer_calls = 0, layer_calls
        self.last = "the split at the first decoder layer"  # the last conversion, for the reports
        self.blocks_on_piece: list[str] = []  # layer children that ran on the piece since then

    def forward(self, input_ids: torch.Tensor) -> None:
        handles = []
        for name in self.points.layers:
            module = self.modules[name]
            handles.append(module.register_forward_pre_hook(self._enter_layer(name), with_kwargs=True))
            handles.append(module.register_forward_hook(self._leave_layer, with_kwargs=True))
        for name, positions in self.points.gathered.items():
            handles.append(self.modules[name].register_forward_pre_hook(self._gather(name, positions),
                                                                        with_kwargs=True))
        for name, positions in self.points.sliced.items():
            handles.append(self.modules[name].register_forward_hook(self._slice(name, positions), with_kwargs=True))
        for name in self.points.layers:
            for child, module in self.modules[name].named_children():
                if f"{name}.{child}" not in self.points.gathered and any(True for _ in module.parameters()):
                    handles.append(module.register_forward_pre_hook(self._on_piece(f"{name}.{child}")))
        try:
            _forward(self.model, input_ids)
        except _Divergence:
            raise
        except Exception as exc:  # the model's own code failed on the piece
            raise _Divergence(self._raised(exc), self._after_layers()) from None
        finally:
            for handle in handles:
                handle.remove()

    def _on_piece(self, name: str):
        def hook(module, args):
            self.blocks_on_piece.append(name)
        return hook

    def _converted(self, where: str) -> None:
        self.last, self.blocks_on_piece = where, []

    def _stretch(self) -> str:
        """What ran on the piece since the last conversion, for the reports."""
        ran = ", ".join(dict.fromkeys(self.blocks_on_piece))
        return f"since {self.last} (the model's own code{' and ' + ran if ran else ''})"

    def _after_layers(self) -> bool:
        """Every decoder layer call of the unsplit forward has ended (the code after them runs)."""
        return self.depth == 0 and self.layer_calls >= self.all_layer_calls

    def _bounds(self, value: torch.Tensor, where: str) -> tuple[int, int]:
        if value.dim() < 2 or value.shape[1] != self.seq_len:
            raise _Divergence(f"{where} has shape {list(value.shape)}, whose dim 1 is not the sequence "
                              f"({self.seq_len} tokens): the split assumes [batch, sequence, hidden]", False)
        width = self.seq_len // PIECES
        return self.piece * width, width

    def _enter_layer(self, name: str):
        def hook(module, args, kwargs):
            self.depth += 1
            positions = ((0,) if name == self.points.split else ()) + self.points.split_inputs
            args, kwargs = list(args), dict(kwargs)
            for position in positions:
                where, key = locate_input(position, args, kwargs, positional_names(module))
                if where is None or not isinstance(where[key], torch.Tensor):
                    continue
                start, width = self._bounds(where[key], f"{name}'s input {position}")
                where[key] = where[key].narrow(1, start, width)
            if name == self.points.split:
                self._converted(f"the split at {name}'s input")
            return tuple(args), kwargs
        return hook

    def _leave_layer(self, module, args, kwargs, output):
        self.depth -= 1
        self.layer_calls += 1

    def _gather(self, name: str, positions: tuple[int, ...]):
        arg_names = positional_names(self.modules[name])

        def hook(module, args, kwargs):
            call = self.calls[name] = self.calls.get(name, -1) + 1
            unsplit = self.reference.get((name, call), {})
            args, kwargs = list(args), dict(kwargs)
            for position in positions:
                where, key = locate_input(position, args, kwargs, arg_names)
                if where is None or not isinstance(where[key], torch.Tensor) or position not in unsplit:
                    continue
                where[key] = self._whole(where[key], unsplit[position], f"{name} (call {call + 1})")
            self._converted(f"{name}'s input")
            return tuple(args), kwargs
        return hook

    def _whole(self, piece: torch.Tensor, unsplit: torch.Tensor, where: str) -> torch.Tensor:
        """The all-gather: the unsplit sequence with this piece's own values in place, after
        checking they are the unsplit model's."""
        start, width = self._bounds(unsplit, f"{where}'s input in the unsplit model")
        want = unsplit.narrow(1, start, width)
        if piece.shape != want.shape:
            raise _Divergence(f"on piece {self.piece + 1} of {PIECES} of the sequence, {where} received shape "
                              f"{list(piece.shape)} where the unsplit model's slice is {list(want.shape)}; the "
                              f"code that ran on the piece {self._stretch()} changed it", self._after_layers())
        gap = (piece.float() - want.float()).abs().max().item() if piece.numel() else 0.0
        if gap > 1e-4 * max(1.0, want.float().abs().max().item()):
            raise _Divergence(f"on piece {self.piece + 1} of {PIECES} of the sequence, the input of {where} "
                              f"differs from the unsplit model's by up to {gap:.3g}: the code that ran on the piece "
                              f"{self._stretch()} is not per-token (a token shift, a convolution or a cumulative "
                              f"sum along the sequence, or tokens routed by the whole sequence)", self._after_layers())
        whole = unsplit.clone().to(piece.dtype)
        whole.narrow(1, start, width).copy_(piece)
        return whole

    def _slice(self, name: str, positions: tuple[int, ...]):
        def cut(value, where: str):
            if not isinstance(value, torch.Tensor):
                return value
            start, width = self._bounds(value, where)
            return value.narrow(1, start, width)

        def hook(module, args, kwargs, output):
            self._converted(f"{name}'s output")
            if not isinstance(output, (tuple, list)):
                return cut(output, f"{name}'s output")
            items = [cut(item, f"{name}'s output {index}") if index in positions else item
                     for index, item in enumerate(output)]
            return items if isinstance(output, list) else tuple(items)
        return hook

    def _raised(self, exc: Exception) -> str:
        """The error and the line of model code it came from (not torch's nor this file's)."""
        frames = [frame for frame in traceback.extract_tb(exc.__traceback__)
                  if "/torch/" not in frame.filename and Path(frame.filename).name != Path(__file__).name]
        at = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""
        message = " ".join(str(exc).split())[:200]
        return (f"on piece {self.piece + 1} of {PIECES} of the sequence, the model's code raised "
                f"{type(exc).__name__}: {message}{at}; the code that ran on the piece {self._stretch()} needs the "
                f"whole sequence")
