"""What a model's loss does with the samples of a batch: found once, at the first step.

Micro-batches weighted by their share of the batch add up to the batch's loss
when the loss is a mean of per-sample terms. `check(model, data)` finds out,
on the first two samples of the first batch (`x2`) and on the same samples
repeated (`x2 + x2`), in inference mode and with no state left changed:

- the loss of the outputs (compiled, or the model's own `compute_loss`) is
  evaluated twice on *one* forward pass, its outputs repeated: a mean over
  samples keeps its value. So a layer that draws random numbers in inference
  mode too (a VAE's sampling layer) cannot make the two differ. A loss that
  does not keep it couples the samples (a sum, a contrastive loss whose
  negatives are the batch's other rows): refused, unless the model trains
  with `whole_batch_loss=True`, which evaluates it once on the whole batch.
  A ratio of the batch's sums (a Dice or Tversky loss) keeps its value on
  repeated samples, so the same outputs are also evaluated one sample at a
  time, each weighted by its share as the micro-batches are (`split`): a
  mean of per-sample terms gives the batch's loss, a ratio of sums does not.
  Each sample's part is also compared with the batch's loss weighted one on
  that sample and zero elsewhere, which differ when Keras divides by a count
  the shares do not know (a loss function that ignores a class itself). A
  loss zero on the two samples and on them repeated tells nothing (a loss of
  pairs of samples on two of one class): the batch's next pairs are probed;
- each term of `model.losses` (`add_loss`, activity and weight
  regularisers) comes from its own forward pass: `MEAN` when it keeps its
  value on the repeated samples (or does not depend on them), `SUM` when it
  doubles; neither is refused. A term that differs between two passes over
  the same samples draws random numbers: it is classified by the nearer of
  the two, within the spread of its draws;
- the `ignore_class` of each output's loss (`SparseCategoricalCrossentropy`),
  from its config: Keras divides such a loss by the elements not ignored, so
  the micro-batches' shares count those (`keras_memopt._step.losses`); and
  whether it sums over the batch (`reduction="sum"`), where the micro-batches'
  losses add up unweighted.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import tensorflow as tf

from keras_memopt import _autograph, _keras
from keras_memopt._keras import losses as _keras_losses
from keras_memopt._step import batch_dependence as _batch_dependence
from keras_memopt._step import layer_metrics as _layer_metrics
from keras_memopt._step import loop as _loop
from keras_memopt._step import metric_check as _metric_check
from keras_memopt._step import rollback as _rollback

MEAN, SUM = "mean", "sum"

# float32 evaluation of the same per-sample terms in another order.
_PROBE_RTOL = 1e-4
# Mixed precision's loss types: a sum of parts rounded each on its own.
_EPSILONS = {tf.float16: 2.0**-10, tf.bfloat16: 2.0**-7}


@dataclasses.dataclass(frozen=True)
class LossForm:
    """What `check` found: one kind per term of `model.losses`, one
    `ignore_class` (or None) per flat output, and whether an output carries a
    mask (Keras then divides its loss by the unmasked elements)."""

    terms: tuple[str, ...] = ()
    ignore_classes: tuple = ()
    masked: bool = False
    # Per flat output, whether its loss sums over the batch (`reduction="sum"`);
    # () where none does.
    summed: tuple = ()
    # One kind per `Mean` metric the layers update in `call` (`layer_metrics.classify`).
    metrics: tuple = ()

    @property
    def counted_by(self) -> str | None:
        """What the batch's counts need, known before the loop: "outputs" (a
        forward pass: an output carries a mask), "targets" (an ignored class
        only), or None (Keras counts samples)."""
        if self.masked:
            return "outputs"
        return "targets" if any(c is not None for c in self.ignore_classes) else None


def overrides(model, name) -> bool:
    """Whether `model`'s class overrides `keras.Model.<name>`."""
    return getattr(type(model), name) is not getattr(_keras.keras.Model, name)


def has_compiled_loss(model) -> bool:
    return _keras_losses.compiled_loss_container(model) is not None


def check(model, data, whole_batch_loss=False, split=None) -> LossForm:
    """Classifies the loss on the first batch; raises for what cannot be split.

    `split(form, x, y, y_pred)`, where given, is `(parts, magnitude, own,
    alone)`: the loss of a few samples' outputs `y_pred` as micro-batches of one
    sample add it up with the shares `form` gives, the sum of the parts'
    absolute values, and for one sample the outputs' loss weighted one on it and
    zero elsewhere and its part (`keras_memopt._step.losses.LossSplit`).

    Raises:
        ValueError: for a loss of the outputs that does not average over
            the samples (unless `whole_batch_loss`), a term of
            `model.losses` that neither averages nor sums over them, or a
            compiled metric that does not add up over micro-batches (unless
            `whole_batch_loss`: `keras_memopt._step.metric_check`).
    """
    if whole_batch_loss and not _keras.REPLACES_MODEL_LOSSES and overrides(model, "compute_loss"):
        raise ValueError(
            "`whole_batch_loss=True` with an overridden `compute_loss` needs Keras 3: "
            "tf_keras has no way to hand it the micro-batches' `add_loss` terms. "
            "Compile the loss instead, or train on Keras 3. Received: "
            f"{type(model).__name__}.compute_loss on tf_keras"
        )
    x, y, _ = _keras.unpack_x_y_sample_weight(data)
    if not [t for t in tf.nest.flatten(x) if t is not None]:
        return LossForm()
    pair = first_samples(x, 2), first_samples(y, 2)
    twice = repeat(pair[0]), repeat(pair[1])
    # What the probes change (metrics, random seeds, counters) is put back, and
    # what tf_keras's forward pass that builds the compiled metrics adds to the
    # layers' own metrics.
    snapshot = _rollback.Snapshot(
        lambda: _rollback.loop_variables(model), model.distribute_strategy
    )
    taken = snapshot.take()
    _keras.build_step_state(model, *pair)
    classes = ignore_classes(model, y)
    form = LossForm((), classes, summed=summed_outputs(model, y))
    try:
        probe = _prober(model)
        once = probe(pair, form, None if whole_batch_loss else split)
        again, doubled = probe(pair, form, None), probe(twice, form, None)
        told = once if whole_batch_loss else _loss_probe(probe, (x, y), form, split, once)
        probes = _term_probes(probe, (x, y), form, (once, again, doubled))
        alone = [sample(pair[0], i) for i in range(int(_loop.batch_size_of(pair[0])))]
        metrics = _layer_metrics.classify(model, pair[0], twice[0], alone)
        coupled = [] if whole_batch_loss or y is None else _metric_check.coupled(model, *twice)
        _batch_dependence.warn(model, x)
    finally:
        for metric in model.metrics:  # the loss trackers may be new
            metric.reset_state()
        snapshot.restore(taken)
    if coupled:
        raise ValueError(_metric_check.message(coupled))
    if not whole_batch_loss and not np.isnan(told[0]):
        if kind_of(told[0], told[1]) != MEAN:
            raise ValueError(_coupled_message(model, what_changed(told[0], told[1])))
        parts, magnitude, own, alone, rtol = told[2:7]
        if not adds_up(told[0], parts, magnitude, rtol):
            raise ValueError(_coupled_message(model, what_split(told[0], parts)))
        if not adds_up(own, alone, magnitude, rtol):
            raise ValueError(_coupled_message(model, what_split(own, alone, alone=True)))
    terms = []
    for index, (a, b, c) in enumerate(probes):
        kind = _term_kind(a, b, c)
        if kind is None:
            raise ValueError(
                "AccumulatingModel cannot split a loss term over micro-batches "
                f"exactly: term {index} of `model.losses` {_term_change(a, c)}, neither the "
                "same (a mean over samples) nor twice as large (a sum). Add it "
                "as separate terms, one that sums over samples and one that "
                f"does not. Received: model.losses[{index}]"
            )
        terms.append(kind)
    return dataclasses.replace(
        form, terms=tuple(terms), masked=bool(once[-1]), metrics=metrics
    )


def _coupled_message(model, changed):
    where = "`compute_loss`" if overrides(model, "compute_loss") else "compiled loss"
    return (
        "AccumulatingModel adds up each micro-batch's loss weighted by its share "
        "of the batch, which equals the batch's loss when the loss is a mean of "
        f"per-sample terms; this {where} is not: on the same outputs it "
        f"{changed}, so it sums over the batch or couples its samples "
        "(a contrastive loss whose negatives are the batch's other rows, a listwise "
        "ranking loss, a ratio of the batch's sums such as a Dice loss, targets of shape "
        "(batch,) broadcast against outputs of shape (batch, 1)). Pass "
        "`whole_batch_loss=True` to AccumulatingModel to evaluate "
        "it once on the whole batch's outputs (exact for any loss of the outputs, "
        "for about one more forward pass), or return one loss value per sample "
        "(Keras averages them). Received: "
        f"loss={getattr(model, 'loss', None)!r}, whole_batch_loss=False"
    )


# A term this small tells nothing by its value (a sum of LayerNormalization
# outputs is zero until their offsets move): its gradient decides.
NEGLIGIBLE = 1e-6


def _terms(values):
    """`(value, gradient norm)` of each term of `model.losses` in a probe's values."""
    count = (len(values) - 8) // 2
    return list(zip(values[7 : 7 + count], values[7 + count : -1], strict=True))


# How many pairs of the first batch's samples a term that tells nothing is probed on.
PAIRS = 8


def _term_probes(probe, data, form, values) -> list:
    """Per term of `model.losses`, its `(value, gradient norm)` on two samples, again
    on them, and on them repeated (`values`: the probes of the first two samples).

    A term that tells nothing there (negligible, without a gradient: a penalty on
    ReLUs dead for both samples) is probed on the batch's next pairs of samples,
    up to `PAIRS` pairs, until it tells; one silent on all of them counts as a
    mean (`_term_kind`).
    """
    probes = list(zip(*(_terms(v) for v in values), strict=True))
    x, y = data
    size = int(_loop.batch_size_of(x))
    for start in range(2, min(size - 1, 2 * PAIRS), 2):
        silent = [i for i, probe in enumerate(probes) if _tells_nothing(*probe)]
        if not silent:
            break
        pair = _loop.micro_slice(x, start, 2), _loop.micro_slice(y, start, 2)
        twice = repeat(pair[0]), repeat(pair[1])
        found = [_terms(probe(p, form, None)) for p in (pair, pair, twice)]
        for index in silent:
            probes[index] = tuple(terms[index] for terms in found)
    return probes


def _loss_probe(probe, data, form, split, once) -> list:
    """The probe of the compiled loss on the first of the batch's pairs of samples
    where it tells something (`once`: the probe of the first two samples).

    A loss that is zero on two samples and on them repeated tells nothing: a loss
    of pairs of the batch's samples is zero on two that make no pair of the kind
    it needs (`keras.losses.Circle` on two samples of one class: no negative),
    and couples the samples all the same. It is probed on the next pairs, up to
    `PAIRS` pairs; one zero on all of them counts as a mean.
    """
    x, y = data
    for start in range(2, min(int(_loop.batch_size_of(x)) - 1, 2 * PAIRS), 2):
        if max(abs(once[0]), abs(once[1])) >= NEGLIGIBLE or np.isnan(once[0]):
            break
        pair = _loop.micro_slice(x, start, 2), _loop.micro_slice(y, start, 2)
        once = probe(pair, form, split)
    return once


def _term_change(once, doubled) -> str:
    """How a term's value (and its gradient norm, where `_term_kind` weighed it) changed."""
    change = what_changed(once[0], doubled[0])
    if max(abs(once[0]), abs(doubled[0])) >= NEGLIGIBLE:
        return change
    return (f"went from {once[0]:.6g} to {doubled[0]:.6g} (below {NEGLIGIBLE:g}) and its "
            f"gradient norm {what_changed(once[1], doubled[1])}")


def _tells_nothing(once, again, doubled) -> bool:
    return max(abs(once[0]), abs(doubled[0])) < NEGLIGIBLE and max(once[1], doubled[1]) == 0


def _term_kind(once, again, doubled):
    """MEAN, SUM or None for one term, from its `(value, gradient norm)` on two
    samples, again on them, and on them repeated.

    Its value decides; where the value is negligible, the gradient's norm,
    which keeps its size when the term averages over samples and doubles when
    it sums over them (or, where it cannot tell, the value if not zero and the
    norm leans its way); a term negligible with no gradient counts as a mean.
    """
    by_value = kind_of(once[0], doubled[0], spread=abs(again[0] - once[0]))
    if max(abs(once[0]), abs(doubled[0])) >= NEGLIGIBLE:
        return by_value
    if _tells_nothing(once, again, doubled):
        return MEAN
    by_gradient = kind_of(once[1], doubled[1], spread=abs(again[1] - once[1]))
    if by_gradient is None and min(abs(once[0]), once[1]) > 0:
        # Quantized (float8), the norm can move (x0.95) where the value, small but
        # not zero, stays to the last bit: the value decides where the norm leans its way.
        ratio = doubled[1] / once[1]
        nearer = MEAN if abs(ratio - 1) < abs(ratio - 2) else SUM
        return by_value if by_value == nearer else None
    return by_gradient


def _prober(model):
    """`probe(data, form, split)`: `_evaluate(model, *data, form, split)` in a replica's
    context (where Keras updates its loss trackers), as a list; Keras's warnings come
    from the step, once.

    Eager, but one `tf.function` for a model with float8 layers: Keras 3's float8
    `Dense` takes gradients only in a graph (an eager `tape.gradient` through it
    raises, in plain Keras with `run_eagerly=True` too). One, with shapes relaxed:
    a function per probe drew TensorFlow's warning about retracing.
    """
    strategy = model.distribute_strategy

    def run(x, y, form, split):
        return strategy.run(_evaluate, args=(model, x, y, form, split))

    if any(_loop.overwritten(v) for v in model.trainable_variables):
        run = _autograph.function(run, reduce_retracing=True)

    def probe(data, form, split):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            values = run(*data, form, split)
        return strategy.experimental_local_results(values)[0].numpy().tolist()

    return probe


def _evaluate(model, x, y, form, split):
    """[loss of the outputs, the same on them repeated (NaN: none), what `split`
    gives and the relative tolerance of the loss's float type (NaN: none), each
    term of `model.losses`, each term's gradient norm, 1 if an output carries a
    mask] on one batch.

    On the repeated samples the losses that sum over the batch (`form.summed`)
    are weighted by one half: a loss that splits then keeps its value.
    """
    # Not the variables the optimizer overwrites with their "gradient" (float8's
    # scales): theirs is a new value, which stays when the samples are repeated.
    variables = [v for v in model.trainable_variables if not _loop.overwritten(v)]
    with tf.GradientTape(persistent=True) as tape:
        y_pred = model(x, training=False)
        terms = [tf.reduce_sum(tf.cast(t, tf.float32)) for t in model.losses]
    norms = [_norm(tape.gradient(term, variables)) for term in terms]
    del tape
    once = twice = nan = tf.constant(float("nan"))
    parts = (nan,) * 5
    if overrides(model, "compute_loss"):
        once = _keras_losses.compute_loss(model, x, y, y_pred, None, training=False)
        twice = _keras_losses.compute_loss(
            model, repeat(x), repeat(y), repeat(y_pred), None, training=False
        )
    elif y is not None and has_compiled_loss(model):
        once = _keras_losses.compiled_loss(model, y, y_pred, None, [])
        halves = _halved_sums(y_pred, form.summed)
        twice = _keras_losses.compiled_loss(model, repeat(y), repeat(y_pred), halves, [])
    masked = any(_keras.get_mask(t) is not None for t in tf.nest.flatten(y_pred))
    if split is not None and once is not nan:
        form = dataclasses.replace(form, masked=masked)
        parts = (*split(form, x, y, y_pred), tolerance(once.dtype))
    values = [once, twice, *parts, *terms, *norms]
    return tf.stack([*(tf.cast(v, tf.float32) for v in values), tf.constant(float(masked))])


def _halved_sums(y_pred, summed):
    """Sample weights of one half on the outputs whose loss sums over the batch, one
    on the others (None where none sums)."""
    if not summed:
        return None
    floatx = _keras.keras.backend.floatx()
    halves = [tf.constant(0.5 if s else 1.0, floatx) for s in summed]
    return tf.nest.pack_sequence_as(y_pred, halves) if tf.nest.is_nested(y_pred) else halves[0]


def _norm(gradients) -> tf.Tensor:
    """The global norm of `gradients` (float32), a sparse one's rows summed first."""
    squares = [tf.zeros([])]
    for gradient in gradients:
        if isinstance(gradient, tf.IndexedSlices):
            gradient = _loop.sum_rows(gradient).values
        if gradient is not None:
            squares.append(tf.reduce_sum(tf.square(tf.cast(gradient, tf.float32))))
    return tf.sqrt(tf.add_n(squares))


# -- each output's loss ------------------------------------------------------------


def output_losses(model, y=None) -> list:
    """Each flat output's compiled loss (None where it has none).

    A dict of losses is matched to the outputs by name: the targets' keys
    where they are a dict (a subclassed model names its outputs nowhere else).
    """
    outputs = y if isinstance(y, dict) else None
    if outputs is None and isinstance(model, _keras.Functional):
        outputs = _keras.nested_inputs_outputs(model)[1]
    if isinstance(outputs, dict):
        names = sorted(outputs)  # the order `tf.nest.flatten` gives a dict's values
    else:
        names = list(getattr(model, "output_names", None) or [])
    loss = getattr(model, "loss", None)
    if isinstance(loss, dict):
        return [loss.get(name) for name in names]
    if isinstance(loss, (list, tuple)):
        return list(loss)
    return [loss] * max(len(names), 1)


def reduction_of(loss) -> str | None:
    """A `keras.losses.Loss`'s reduction in lower case, on both lines (None: a
    function or a name, which average over the samples)."""
    reduction = getattr(loss, "reduction", None)
    return None if reduction is None else str(reduction).lower()


def ignore_classes(model, y=None) -> tuple:
    """The `ignore_class` of each flat output's compiled loss (None where none)."""
    classes = []
    for item in output_losses(model, y):
        config = item.get_config() if hasattr(item, "get_config") else {}
        classes.append(config.get("ignore_class"))
    return tuple(classes) if any(c is not None for c in classes) else ()


def summed_outputs(model, y=None) -> tuple:
    """Whether each flat output's compiled loss sums over the batch (`reduction="sum"`:
    its micro-batches' losses add up to the batch's unweighted); () where none does."""
    summed = tuple(reduction_of(item) == "sum" for item in output_losses(model, y))
    return summed if any(summed) else ()


# -- the probe's data ------------------------------------------------------------------


def first_samples(data, count):
    return _loop.micro_slice(data, 0, count)


def repeat(data):
    """Every sample twice (`x + x`), masks and the logits behind a softmax or
    sigmoid output included (Keras's cross-entropies read those)."""
    return _rebuilt(data, lambda t: _loop.concat_rows([t, t]))


def sample(data, index):
    """Sample `index` of a batch, as `repeat` keeps masks and logits."""
    return _rebuilt(data, lambda t: _loop.rows(t, index, 1))


def _rebuilt(data, rows):
    """`rows(t)` of each tensor `t` of `data`, with `rows` of its mask and of
    the logits Keras reads behind it."""

    def rebuilt(t):
        if t is None:
            return None
        mask, logits = _keras.get_mask(t), _keras.logits_of(t)
        result = rows(t)
        if logits is not None:
            result = _keras.carry_logits(result, rows(logits), t)
        if mask is not None:
            _keras.set_mask(result, rows(mask))
        return result

    return tf.nest.map_structure(rebuilt, data)


def kind_of(once, twice, spread=0.0):
    """MEAN if a value stays when every sample is repeated, SUM if it doubles, else None.

    `spread`: how far two evaluations on the same samples differ (random
    draws); the tolerance grows with it.
    """
    scale = max(abs(once), abs(twice), 1e-12)
    tolerance = _PROBE_RTOL * scale
    if spread > tolerance:  # random: the nearer of the two, within the draws' spread
        tolerance = max(4 * spread, 0.25 * scale)
    to_mean, to_sum = abs(twice - once), abs(twice - 2 * once)
    if to_mean <= tolerance and to_mean <= to_sum:
        return MEAN
    if to_sum <= tolerance:
        return SUM
    return None


def tolerance(dtype) -> float:
    """The relative tolerance of `adds_up` for a loss of `dtype`: mixed precision's
    float16 and bfloat16 losses round each sample's part on its own."""
    return max(_PROBE_RTOL, 4 * _EPSILONS.get(tf.as_dtype(dtype), 0.0))


def adds_up(whole, parts, magnitude, rtol=_PROBE_RTOL) -> bool:
    """Whether the parts' loss `parts` is the batch's `whole` (either NaN: not
    evaluated), within float rounding of the parts' `magnitude`."""
    if np.isnan(parts) or np.isnan(whole):
        return True
    return abs(parts - whole) <= rtol * max(abs(whole), abs(magnitude), 1e-12)


def what_split(whole, parts, alone=False):
    if alone:
        return (
            f"was {whole:.6g} on two samples weighted 1 on one and 0 on the other but "
            f"{parts:.6g} on that one alone weighted by its share, as a micro-batch adds it up"
        )
    return (
        f"was {whole:.6g} on two samples but {parts:.6g} as the sum of each sample's "
        "loss weighted by its share, as micro-batches add it up"
    )


def what_changed(once, twice):
    ratio = f" (x{twice / once:.3g})" if once else ""
    return f"went from {once:.6g} to {twice:.6g}{ratio} when every sample was repeated"
