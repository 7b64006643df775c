"""Executors: the vectorized executor trains, steps and evaluates as the sequential one does, and falls back with a
notice; every method runs vectorized as sequential (on Ray: tests/test_ray.py)."""

import contextlib
import copy
import csv
import math
import pickle
import warnings
from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from plfl import experiment
from plfl.batches import training_rows
from plfl.checkpoint import load_latest_checkpoint
from plfl.client import ClientModule
from plfl.data import ClientData, FederatedData
from plfl.errors import ConfigError, PlflWarning
from plfl.executors import VectorizedExecutor, build_executor, drive
from plfl.executors.lockstep import MaskedBatchNorm, masked, masked_batch_norms
from plfl.executors.options import ClientWorkOptions, Vectorized
from plfl.executors.step_graphs import StepGraphs
from plfl.experiment import run_experiment
from plfl.methods.ala import ALAConfig, local_aggregation
from plfl.methods.fedavg import FedAvg, FedAvgConfig
from plfl.methods.moon import MOON, MOONConfig
from plfl.methods.perfedavg import PerFedAvg, PerFedAvgConfig
from plfl.models import build_model
from plfl.sections import FederationConfig, TrainerConfig
from plfl.tasks import (
    ClientFailure,
    EvalTask,
    FeatureTask,
    ProximalTerm,
    Step,
    StepOutput,
    StepTask,
    TrainResult,
    TrainTask,
    sample_count,
)

from conftest import every_method, make_context, matrix_config, run_results, sequential


def vectorized(context, cohort_size=None, augment=False) -> VectorizedExecutor:
    """The vectorized executor of ``context`` on the CPU, falling back to its sequential one."""
    federation = FederationConfig(**{**vars(context.federation), "executor": "vectorized"})
    work, options = ClientWorkOptions(federation, TrainerConfig(), augment), Vectorized(cohort_size=cohort_size)
    return VectorizedExecutor(
        context.data, context.architecture, work, options, torch.device("cpu"), sequential(context)
    )


def ala_tasks(context, config, messages, locals_, weights=None) -> list[StepTask]:
    """The first ALA step task of each client i (``messages[i]`` received, ``locals_[i]`` its old model,
    ``weights[i]`` its W_i or None for the initial stage), as plfl.methods.ala.local_aggregation yields it in
    round 1 (after its feature task, run on the sequential executor, when ALA learns head tensors only)."""
    tasks = []
    for i, (message, local) in enumerate(zip(messages, locals_)):
        if weights is not None and weights[i] is not None:
            context.store.set(i, "ala_weights", weights[i])
        hook = local_aggregation(config, context, i, message, local, round_=1)
        task = next(hook)
        if isinstance(task, FeatureTask):
            task = hook.send(sequential(context).features([task])[0])
        tasks.append(task)
    return tasks


def run(digits_config, executor, **options):
    """(per-round accuracies, per-client accuracies, every client's final model) of a 3-round digits run."""
    run_dir, _ = run_experiment(digits_config(**{"federation.executor": executor, **options}))
    with open(run_dir / "metrics.csv") as f:
        rounds = [float(row["accuracy"]) for row in csv.DictReader(f)]
    with open(run_dir / "clients.csv") as f:
        clients = [float(row["accuracy"]) for row in csv.DictReader(f)]
    store = load_latest_checkpoint(run_dir / "checkpoints")[1]["store"]
    return rounds, clients, [client["model"] for client in store]


def assert_executors_agree(digits_config, **options):
    """:func:`run` on the sequential executor and on the vectorized one (cohorts of 3, no fallback): the same
    accuracies to 4 decimals and final models within 1e-5. Returns the sequential run's final models."""
    sequential = run(digits_config, "sequential", **options)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="federation.executor=vectorized")  # no fallback
        vectorized = run(digits_config, "vectorized", **options, **{"vectorized.cohort_size": 3})
    for one, other in zip(sequential[:2], vectorized[:2]):
        assert [round(a, 4) for a in one] == [round(a, 4) for a in other]
    for one, other in zip(sequential[2], vectorized[2]):
        for key in one:
            torch.testing.assert_close(one[key], other[key], atol=1e-5, rtol=0)
    return sequential[2]


class Shipped:
    """``executor`` behind a pickle round trip of every call's tasks and results, as the Ray executor sends tasks
    to its actors and gets their results back (classes by reference: a method's steps must be importable)."""

    def __init__(self, executor):
        self.executor = executor

    def __getattr__(self, name):
        run = getattr(self.executor, name)
        if name not in ("train", "step", "features", "evaluate"):
            return run
        return lambda tasks: pickle.loads(pickle.dumps(run(pickle.loads(pickle.dumps(tasks)))))


@pytest.mark.parametrize("method", every_method())
def test_vectorized_runs_every_method_as_sequential(tmp_path, sequential_results, monkeypatch, method):
    """Every method's training, own steps and evaluation in lock-step (5 clients in cohorts of 3 and 2), its
    tasks and results pickled on the way to and from the executor as the Ray executor ships them: the
    sequential executor's accuracies (to 4 decimals) and final models (to 1e-5), with no fallback."""
    monkeypatch.setattr(experiment, "build_executor", lambda *args: Shipped(build_executor(*args)))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="federation.executor=vectorized")  # no fallback
        run_dir, _ = run_experiment(matrix_config(tmp_path, method, "vectorized", **{"vectorized.cohort_size": 3}))
    metrics, clients, models = run_results(run_dir)
    expected_metrics, expected_clients, expected_models = sequential_results(method)
    for rows, expected in ((metrics, expected_metrics), (clients, expected_clients)):
        accuracy = [round(float(row["accuracy"]), 4) for row in rows if row["accuracy"]]
        assert accuracy == [round(float(row["accuracy"]), 4) for row in expected if row["accuracy"]]
    for one, other in zip(models, expected_models):
        assert one.keys() == other.keys()
        for key in one:
            torch.testing.assert_close(one[key], other[key], atol=1e-5, rtol=0)


def test_batch_order_is_local_trainers_across_fits_and_epochs(tiny_federation, monkeypatch):
    context, _ = make_context(tiny_federation)  # batch size 5
    seen = []
    step = ClientModule.training_step

    def recorded(batches):  # ((x, y), batch_idx, dataloader_idx) items; x[:, 0] holds the sample's index
        for batch in batches:
            seen.append(batch[0][0][:, 0].long().tolist())
            yield batch

    def recording(self, dataloader_iter):
        return step(self, recorded(dataloader_iter))

    monkeypatch.setattr(ClientModule, "training_step", recording)
    x, y = torch.arange(23.0).unsqueeze(1).repeat(1, 8), torch.zeros(23, dtype=torch.long)
    for options in ({"epochs": 2}, {"steps": 7}, {"steps": 12}, {"epochs": 1}):  # steps run on into later epochs
        seen.clear()
        sequential(context).trainer.train(context.architecture.state_dict(), x, y, seed=11, **options)
        rows = training_rows(23, 5, 11, **options)
        assert seen == [[i for i in row if i >= 0] for row in rows.tolist()]


def test_a_diverging_client_fails_alone(tiny_federation):
    context, model = make_context(tiny_federation)
    executor = vectorized(context)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    broken = {**start, "head.bias": torch.full_like(start["head.bias"], float("nan"))}
    tasks = [TrainTask(i, broken if i == 2 else start, seed=i, epochs=1) for i in range(4)]
    results = executor.train(tasks)
    assert results[2] == ClientFailure("its trained parameter 'body.1.weight' holds NaN or Inf (training diverged)")
    expected = sequential(context).train(tasks[:2] + tasks[3:])
    for result, alone in zip(results[:2] + results[3:], expected):
        assert isinstance(result, TrainResult) and result.samples_seen == alone.samples_seen
        for key in alone.params:
            torch.testing.assert_close(result.params[key], alone.params[key], atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "method", [pytest.param("fedavg", marks=pytest.mark.slow), pytest.param("fedala", marks=pytest.mark.slow), "fedbn"]
)
def test_batch_norm_runs_vectorized_as_sequential(digits_config, method):
    """Per-client batch statistics of the real samples only (batch 7: short last batches; a client with
    n mod 7 = 1 drops a sample each epoch, LocalTrainer's BatchNorm rule) and per-client running statistics."""
    options = {"method.name": method, "model.batch_norm": True, "federation.batch_size": 7, "federation.momentum": 0.5}
    models = assert_executors_agree(digits_config, **options)
    assert all(any("running_var" in key for key in model) for model in models)


@pytest.mark.parametrize(
    "attack, rule",
    [
        ("sign_flip", "median"),
        ("gaussian", "norm_bound"),
        ("label_flip", "krum"),
        ("scale", "multi_krum"),
        ("backdoor", "trimmed_mean"),
    ],
)
def test_poisoned_clients_and_robust_rules_run_vectorized_as_sequential(digits_config, attack, rule):
    """The same malicious clients, the same flipped labels and attacked messages, the same rule on either executor."""
    options = {"attack.kind": attack, "attack.fraction": 0.4, "aggregation.rule": rule}
    assert_executors_agree(digits_config, **options)


def test_adaptive_client_dp_runs_vectorized_as_sequential(digits_config):
    """The DP noise and the clip norm's noise come from (seed, round) on the server: the same on either executor."""
    options = {"privacy.level": "client", "privacy.adaptive": True, "privacy.noise_multiplier": 0.3}
    assert_executors_agree(digits_config, **options)


def test_step_graphs_replay_the_step_first_recorded_for_a_key_after_undoing_its_warm_up():
    counter, seen = torch.zeros(()), []
    steps = StepGraphs(capture=False, warmup=2)
    for value in (1.0, 2.0, 3.0):
        steps("add", lambda v=value: (seen.append(v), counter.add_(v)), lambda: [counter])
    assert counter.item() == 3.0  # the first step, replayed: the later steps' values never run
    assert seen == [1.0] * 5  # two warm-up calls (undone) and three replays
    steps.clear()
    steps("add", lambda: counter.add_(10.0), lambda: [counter])
    assert counter.item() == 13.0


class FakeStream:
    def wait_stream(self, other):
        pass


class NoOpGraph:
    def replay(self):
        pass


def fake_cuda(monkeypatch, graph) -> None:
    """torch.cuda's stream and graph calls faked (CI has no GPU), ``graph`` in place of ``torch.cuda.graph``."""
    for name, fake in {
        "graph_pool_handle": lambda: None,
        "Stream": FakeStream,
        "current_stream": FakeStream,
        "stream": lambda s: contextlib.nullcontext(),
        "CUDAGraph": NoOpGraph,
        "graph": graph,
        "empty_cache": lambda: None,
    }.items():
        monkeypatch.setattr(torch.cuda, name, fake)


def test_a_step_cuda_cannot_capture_runs_without_graphs_after_one_notice(monkeypatch):
    def refuse(graph, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    fake_cuda(monkeypatch, refuse)
    counter = torch.zeros(())
    steps = StepGraphs(capture=True, warmup=2)
    with pytest.warns(
        PlflWarning,
        match=r"^vectorized.cuda_graphs: capturing a lock-step step failed \(operation "
        r"not permitted when stream is capturing\); the vectorized executor runs "
        r"its steps without CUDA graphs.$",
    ):
        steps("add", lambda: counter.add_(1.0), lambda: [counter])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        steps("add", lambda: counter.add_(5.0), lambda: [counter])
        steps("other", lambda: counter.add_(10.0), lambda: [counter])  # no more capture, no warm-up
    assert counter.item() == 1.0 + 1.0 + 10.0  # the warm-up undone; "add" replays its first step


def test_a_graph_that_replays_wrongly_is_dropped_before_it_trains_anyone(monkeypatch):
    fake_cuda(monkeypatch, lambda graph, pool: contextlib.nullcontext())  # "captures" a replay that does nothing
    counter = torch.zeros(())
    steps = StepGraphs(capture=True, warmup=1)
    with pytest.warns(PlflWarning, match="a captured step's replay differs from the step run eagerly"):
        steps("add", lambda: counter.add_(1.0), lambda: [counter])
    steps("add", lambda: counter.add_(1.0), lambda: [counter])
    assert counter.item() == 2.0 and not steps.capture


class RecordingGraph:
    """A fake CUDA graph whose replay runs again the steps called during its capture."""

    capturing: "RecordingGraph | None" = None

    def __init__(self):
        self.steps = []

    def replay(self):
        for step in self.steps:
            step()


def test_steps_recorded_after_clear_go_to_a_new_memory_pool(monkeypatch):
    """A capture into the pool of graphs that clear() destroyed fails PyTorch's allocator assert
    (use_count > 0), so clear() takes a new pool handle for the next captures."""
    pools = []

    @contextlib.contextmanager
    def capture(graph, pool):
        pools.append(pool)
        RecordingGraph.capturing = graph
        yield
        RecordingGraph.capturing = None

    fake_cuda(monkeypatch, capture)
    handles = iter(range(1, 10))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", RecordingGraph)
    counter = torch.zeros(())

    def add(amount):
        def step():
            counter.add_(amount)
            if RecordingGraph.capturing is not None:
                RecordingGraph.capturing.steps.append(step)

        return step

    steps = StepGraphs(capture=True, warmup=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        steps("a", add(1.0), lambda: [counter])
        steps("a", add(1.0), lambda: [counter])
        steps.clear()
        steps("b", add(10.0), lambda: [counter])
    assert pools == [1, 2] and steps.capture
    assert counter.item() == 1.0 + 1.0 + 10.0  # warm-ups and checks undone; each call one step


@pytest.mark.parametrize("batch_norm", [False, True])
def test_features_are_the_body_outputs_on_a_step_tasks_batches(tiny_federation, batch_norm):
    """body(x) of the samples in their order, in training mode: with BatchNorm each batch of ``batch_size``
    normalised by its own statistics, and a last batch of one sample left out as a step task leaves it out."""
    model = build_model("mlp", tiny_federation.input_shape, 3, hidden_sizes=[16], batch_norm=batch_norm)
    context, _ = make_context(tiny_federation, model=model)
    params = {k: v.clone() for k, v in model.state_dict().items()}
    samples = torch.tensor([7, 2, 9, 0, 4, 1])  # of client 0's 10: batches [7, 2, 9, 0, 4] and [1]
    task = FeatureTask(0, params, samples, batch_size=5)
    client = tiny_federation.clients[0]
    kept = samples[:5] if batch_norm else samples
    with torch.no_grad():
        expected = model.train().body(client.x_train[kept])
    for executor in (sequential(context), vectorized(context)):
        (result,) = executor.features([task])
        assert torch.allclose(result.x, expected, atol=1e-5) and result.x.shape == (len(kept), 16)
        assert torch.equal(result.y, client.y_train[kept])


@dataclass(frozen=True)
class BatchMeans(Step):
    """Adds each batch's mean sample to the state ``total``."""

    def __call__(self, network, state, inputs, shared, batch):
        mean = batch.x.mean(0) if batch.mask is None else (batch.x * batch.mask[:, None]).sum(0) / batch.mask.sum()
        return StepOutput({"total": state["total"] + mean}, mean.sum(), sample_count(batch))


def test_a_step_task_on_given_samples_steps_on_them_in_order(tiny_federation):
    """``data`` in place of the training split: the batches index the given samples, on every executor."""
    context, _ = make_context(tiny_federation)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in (7, 3)]
    tasks = [
        StepTask(i, BatchMeans(), {"total": torch.zeros(8)}, 0, 5, epochs=2, data=d, ordered_samples=torch.arange(n))
        for i, (d, n) in enumerate(zip(data, (7, 3)))
    ]
    first, second = data[0][0], data[1][0]
    expected = [2 * (first[:5].mean(0) + first[5:].mean(0)), 2 * second.mean(0)]
    stacked = vectorized(context)
    for results in (sequential(context).step(tasks), stacked.step(tasks), stacked.step(tasks)):  # kept on device
        for result, total in zip(results, expected):
            assert torch.allclose(result.state["total"], total, atol=1e-6)
        assert [r.samples_seen for r in results] == [14, 6]


def test_warmed_up_recorded_steps_train_as_steps_run_once(tiny_federation):
    """A CUDA graph's capture needs warm-up calls of the step first; the tensors they train (BatchNorm statistics,
    momentum, loss sums; a method's step state and losses, here ALA's) or count into (evaluation) are restored
    after, so that each client still takes exactly its own steps."""
    model = build_model(
        "mlp", tiny_federation.input_shape, tiny_federation.num_classes, hidden_sizes=[16], batch_norm=True
    )
    context, _ = make_context(tiny_federation, model=model, momentum=0.5)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    anchor = {k: v + 0.1 for k, v in start.items()}
    tasks = [TrainTask(i, start, seed=i, epochs=2, proximal=ProximalTerm(anchor, 0.3)) for i in range(4)]
    ala = ala_tasks(context, ALAConfig(s=80, p=2, max_init_epochs=4), [anchor] * 4, [start] * 4)
    results = []
    for warmup in (0, 3):
        executor = vectorized(context, cohort_size=3)
        executor.graphs = executor.stacked_steps.graphs = StepGraphs(capture=False, warmup=warmup)
        results.append(
            (
                executor.train(tasks),
                executor.step(ala),
                executor.evaluate([EvalTask(i, anchor) for i in range(4)] + [EvalTask(i, start) for i in range(4)]),
            )
        )
    (trained, stepped, evaluated), (trained_warm, stepped_warm, evaluated_warm) = results
    assert evaluated == evaluated_warm
    for once, warmed in zip(trained, trained_warm):
        assert once.loss == warmed.loss and once.samples_seen == warmed.samples_seen
        assert all(torch.equal(once.params[k], warmed.params[k]) for k in start)
    for once, warmed in zip(stepped, stepped_warm):
        assert once.epoch_losses == warmed.epoch_losses
        assert all(torch.equal(once.state[k], warmed.state[k]) for k in once.state)


def test_steps_of_two_layouts_in_turn_are_each_recorded_once(tiny_federation, monkeypatch):
    """A method with steps of two layouts each round (FedPAC's head and body; here ALA's and MOON's) keeps a state
    per layout: the second round records nothing and gives the first round's results."""
    context, model = make_context(tiny_federation)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    anchor = {k: v + 0.1 for k, v in start.items()}
    moon = MOON(MOONConfig(), context, start)
    layouts = [
        ala_tasks(context, ALAConfig(s=80, p=2, max_init_epochs=2), [anchor] * 4, [start] * 4),
        [next(moon.local_train(i, start, anchor, 1)) for i in range(4)],
    ]
    executor = vectorized(context)
    executor.graphs = executor.stacked_steps.graphs = StepGraphs(capture=False, warmup=1)
    recorded = []
    record = executor.graphs._record
    monkeypatch.setattr(executor.graphs, "_record", lambda *args: recorded.append(1) or record(*args))
    rounds = []
    for _ in range(2):
        rounds.append([executor.step(tasks) for tasks in layouts])
        rounds[-1].append(len(recorded))
    (*first, recorded_first), (*second, recorded_second) = rounds
    assert recorded_first > 0 and recorded_second == recorded_first
    for results, again in zip(first, second):
        for one, other in zip(results, again):
            assert one.epoch_losses == other.epoch_losses
            assert all(torch.equal(one.state[k], other.state[k]) for k in one.state)


# Ops that read a tensor's value on the host (item, bool, nonzero's size, ...): on a GPU each waits for the
# device, which CUDA forbids while it captures a graph.
SYNCHRONISING = {
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.masked_select",
    "aten.is_nonzero",
    "aten.equal",
    "aten._unique2",
    "aten.unique_consecutive",
    "aten.unique_dim",
    "aten.repeat_interleave",
}


class RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def tiny_images() -> FederatedData:
    """3 clients of 7, 12 and 5 random 1×28×28 images, 3 classes."""
    g = torch.Generator().manual_seed(0)
    return FederatedData(
        "images",
        [
            ClientData(
                torch.randn(n, 1, 28, 28, generator=g),
                torch.randint(0, 3, (n,), generator=g),
                torch.randn(4, 1, 28, 28, generator=g),
                torch.randint(0, 3, (4,), generator=g),
            )
            for n in (7, 12, 5)
        ],
        num_classes=3,
        input_shape=(1, 28, 28),
    )


@pytest.mark.parametrize("p", [2, 3], ids=["ala-head-only", "ala-with-body"])
def test_training_ala_and_evaluation_steps_never_read_a_tensor_on_the_host(tiny_images, p):
    """What a CUDA graph can capture: the recorded steps (training a BatchNorm CNN with momentum and a proximal
    term, ALA, evaluation) dispatch no op that synchronises the device with the host."""
    model = build_model("cnn", tiny_images.input_shape, tiny_images.num_classes, batch_norm=True)
    context, _ = make_context(tiny_images, model=model, momentum=0.5)
    executor = vectorized(context)
    recorder = RecordOps()

    def recorded(step):
        def run(*args):
            with recorder:
                step(*args)

        return run

    for owner, name in ((executor, "_train_step"), (executor.stacked_steps, "_step"), (executor, "_evaluation_step")):
        setattr(owner, name, recorded(getattr(owner, name)))
    start = model.state_dict()
    executor.train([TrainTask(i, start, seed=i, epochs=1, proximal=ProximalTerm(start, 0.1)) for i in range(3)])
    executor.step(ala_tasks(context, ALAConfig(p=p), [start] * 3, [start] * 3))
    executor.evaluate([EvalTask(i, start) for i in range(3)])
    assert {"aten.convolution_backward", "aten.max_pool2d_with_indices", "aten.argmax"} <= recorder.ops
    assert not recorder.ops & SYNCHRONISING


def test_an_unsupported_layer_falls_back_to_sequential_with_one_notice(digits_config):
    options = {"federation.rounds": 1, "trainer.precision": "bf16-mixed"}
    with pytest.warns(PlflWarning) as caught:
        vectorized = run(digits_config, "vectorized", **options)
    notices = [str(w.message) for w in caught if "federation.executor" in str(w.message)]
    assert notices == [
        "federation.executor=vectorized runs this work on the sequential executor: "
        "trainer.precision=bf16-mixed (it computes in float32 only)."
    ]
    sequential = run(digits_config, "sequential", **options)
    assert vectorized[:2] == sequential[:2]
    assert all(torch.equal(a[k], b[k]) for a, b in zip(vectorized[2], sequential[2]) for k in a)


def test_augmentation_falls_back_for_training_only(tiny_federation):
    context, model = make_context(tiny_federation)
    executor = vectorized(context, augment=True)
    start = model.state_dict()
    with pytest.warns(
        PlflWarning, match="runs this work on the sequential executor: data.augment draws random crops and flips.$"
    ):
        executor.train([TrainTask(0, start, seed=0, epochs=1)])
    tasks = [EvalTask(1, start), EvalTask(2, start)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no notice: evaluation stays vectorized
        results = executor.evaluate(tasks)
    for result, expected in zip(results, sequential(context).evaluate(tasks)):
        assert result.correct == expected.correct and result.total == expected.total
        assert result.loss == pytest.approx(expected.loss, abs=1e-6)


def test_a_subset_of_the_training_split_trains_and_evaluates_on_those_samples_only(tiny_federation):
    """FedFomo's validation hold-out: training and evaluation on part of a client's training split, in lock-step
    with a client that trains on all of it (no fallback)."""
    context, model = make_context(tiny_federation)
    start, samples = {k: v.clone() for k, v in model.state_dict().items()}, torch.tensor([0, 2, 3, 5, 7, 9, 1])
    tasks = [TrainTask(0, start, seed=0, epochs=2, samples=samples), TrainTask(1, start, seed=1, epochs=2)]
    evaluations = [EvalTask(0, start, samples=samples), EvalTask(1, start)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        results, evaluated = vectorized(context).train(tasks), vectorized(context).evaluate(evaluations)
    client = tiny_federation.clients[0]
    expected = sequential(context).trainer.train(
        start, client.x_train[samples], client.y_train[samples], seed=0, epochs=2
    )
    assert results[0].samples_seen == 14
    for key, value in expected.params.items():
        torch.testing.assert_close(results[0].params[key], value, atol=1e-6, rtol=0)
    for one, other in zip(evaluated, sequential(context).evaluate(evaluations)):
        assert (one.correct, one.total) == (other.correct, other.total) and one.total in (7, 6)
        assert one.loss == pytest.approx(other.loss, abs=1e-6)


def test_vectorized_needs_a_device_it_knows(tiny_federation):
    _, model = make_context(tiny_federation)
    work = ClientWorkOptions(FederationConfig(executor="vectorized"), TrainerConfig(accelerator="tpu"))
    with pytest.raises(
        ConfigError,
        match="federation.executor=vectorized runs on trainer.accelerator cpu, gpu, cuda, "
        "mps or auto, not tpu. Set federation.executor=sequential.",
    ):
        build_executor(work, Vectorized(), tiny_federation, model)


@pytest.mark.parametrize(
    "p, shared", [(2, True), (2, False), (3, True)], ids=["head-only", "head-only-separate-messages", "with-body"]
)
def test_vectorized_ala_learns_the_weights_of_sequential_ala(tiny_federation, p, shared):
    """Clients in and after the initial stage together, their hooks lock-stepped an epoch at a time, in cohorts of
    2: the same W_i, models and epochs as one client at a time (FedALA, Eq. 3–5), including clients that settle
    after different numbers of epochs; with one global model for all clients (kept once) or a copy each."""
    config = ALAConfig(s=80, p=p, eta=2.0, threshold=0.02, num_pre_loss=2, max_init_epochs=6)
    outcomes = []
    for kind in ("sequential", "vectorized"):
        torch.manual_seed(1)
        context, model = make_context(tiny_federation)
        states = [{k: v + 0.3 * torch.randn_like(v) for k, v in model.state_dict().items()} for _ in range(4)]
        top = [name for name, _ in model.named_parameters()][-p:]
        context.store.set(1, "ala_weights", {k: torch.rand_like(states[1][k]) for k in top})
        messages = [states[0] if shared else {k: v.clone() for k, v in states[0].items()} for _ in range(4)]
        hooks = [local_aggregation(config, context, i, messages[i], states[i], round_=1) for i in range(4)]
        executor = sequential(context) if kind == "sequential" else vectorized(context, cohort_size=2)
        models = drive(hooks, executor)
        weights = [context.store.get(i, "ala_weights") for i in range(4)]
        outcomes.append((models, weights, [context.store.get(i, "ala_epochs") for i in range(4)]))
    (models, weights, epochs), (models_v, weights_v, epochs_v) = outcomes
    assert epochs_v == epochs and epochs[1] == 1 and len(set(epochs)) > 1  # the initial stages differ
    for one, other in zip(weights + models, weights_v + models_v):
        assert one.keys() == other.keys()
        for key in one:
            torch.testing.assert_close(one[key], other[key], atol=1e-5, rtol=0)


def test_drop_last_trains_on_full_batches_only_in_both_executors_and_in_a_methods_step(tiny_federation):
    """federation.drop_last (PFLlib's loaders): clients of 10, 20, 30 and 40 samples in batches of 7 train on 7,
    14, 28 and 35 a local epoch (without it on all of them), by local training and by MOON's step, on the
    sequential and the vectorized executor alike."""
    full = [7, 14, 28, 35]
    for drop_last, per_epoch in ((True, full), (False, [10, 20, 30, 40])):
        context, model = make_context(tiny_federation, batch_size=7, drop_last=drop_last)
        start = {k: v.clone() for k, v in model.state_dict().items()}
        moon = MOON(MOONConfig(), context, start)
        trains = [TrainTask(i, start, seed=i, epochs=2) for i in range(4)]
        steps = [next(moon.local_train(i, start, start, 1)) for i in range(4)]
        trained = [executor.train(trains) for executor in (sequential(context), vectorized(context))]
        stepped = [executor.step(steps) for executor in (sequential(context), vectorized(context))]
        for field, (one, other) in (("params", trained), ("state", stepped)):
            for a, b in zip(one, other):
                assert a.samples_seen == b.samples_seen
                for key, value in getattr(a, field).items():
                    torch.testing.assert_close(value, getattr(b, field)[key], atol=1e-5, rtol=0)
        assert [r.samples_seen for r in trained[0]] == [2 * n for n in per_epoch]
        assert [r.samples_seen for r in stepped[0]] == per_epoch


def test_local_steps_train_every_client_the_same_batches_in_both_executors_and_in_a_methods_step(tiny_federation):
    """federation.local_steps=5 in batches of 7: clients of 10, 20, 30 and 40 samples take 5 batches each, the
    batch order running on across epochs (10: 7+3+7+3+7; 20: 7+7+6+7+7; 30: 4·7+2; 40: 5·7), by a method's local
    training and by MOON's step, on the sequential and the vectorized executor alike."""
    context, model = make_context(tiny_federation, batch_size=7, local_steps=5)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    fedavg, moon = FedAvg(FedAvgConfig(), context, start), MOON(MOONConfig(), context, start)
    trains = [next(fedavg.local_train(i, start, start, 1)) for i in range(4)]
    steps = [next(moon.local_train(i, start, start, 1)) for i in range(4)]
    assert {(task.steps, task.epochs) for task in trains + steps} == {(5, None)}
    trained = [executor.train(trains) for executor in (sequential(context), vectorized(context))]
    stepped = [executor.step(steps) for executor in (sequential(context), vectorized(context))]
    for field, (one, other) in (("params", trained), ("state", stepped)):
        for a, b, seen in zip(one, other, [27, 34, 30, 35]):
            assert a.samples_seen == b.samples_seen == seen
            for key, value in getattr(a, field).items():
                torch.testing.assert_close(value, getattr(b, field)[key], atol=1e-5, rtol=0)


def test_clients_of_different_lengths_train_in_one_cohort_as_sequential(tiny_federation, monkeypatch):
    """Self-FL's clients each train their own l_m steps: one cohort, its members stopping at their own length."""
    context, model = make_context(tiny_federation, batch_size=7)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    tasks = [TrainTask(i, start, seed=i, steps=s) for i, s in enumerate((2, 5, 1))] + [TrainTask(3, start, 3, epochs=1)]
    executor = vectorized(context)
    cohorts = []
    run_cohort = executor._train_cohort
    monkeypatch.setattr(
        executor, "_train_cohort", lambda tasks, rows: cohorts.append(len(tasks)) or run_cohort(tasks, rows)
    )
    for one, other in zip(sequential(context).train(tasks), executor.train(tasks)):
        assert one.samples_seen == other.samples_seen
        for key, value in one.params.items():
            torch.testing.assert_close(value, other.params[key], atol=1e-5, rtol=0)
    assert cohorts == [4]


def test_drop_last_refuses_a_client_smaller_than_a_batch(digits_config):
    with pytest.raises(ConfigError, match=r"federation.drop_last=true leaves \d+ client\(s\) without a full batch"):
        run_experiment(digits_config(**{"federation.drop_last": True, "federation.batch_size": 1000}))


def test_a_client_without_a_batch_takes_no_step_on_either_executor():
    """Per-FedAvg on a client of 5 samples at batch size 5: its one loader batch of 2B = 10 cannot hold D and D′,
    so no step runs; beside a client that trains, both executors return its state unchanged with no samples."""
    g = torch.Generator().manual_seed(0)
    data = FederatedData(
        "two",
        [
            ClientData(
                torch.randn(n, 8, generator=g),
                torch.randint(0, 3, (n,), generator=g),
                torch.randn(2, 8),
                torch.zeros(2, dtype=torch.long),
            )
            for n in (5, 23)
        ],
        num_classes=3,
        input_shape=(8,),
    )
    context, model = make_context(data)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    method = PerFedAvg(PerFedAvgConfig(), context, start)
    tasks = [next(method.local_train(i, start, start, 1)) for i in range(2)]
    for results in (sequential(context).step(tasks), vectorized(context).step(tasks)):
        idle, trained = results
        assert idle.samples_seen == 0 and idle.epoch_losses == [] and math.isnan(idle.loss)
        assert all(torch.equal(idle.state[k], v) for k, v in start.items())
        assert trained.samples_seen == 20  # 23 = 2 × 10 + a short rest of 3, left out


@pytest.mark.slow
def test_resnet18_trains_and_evaluates_vectorized_as_sequential():
    """torchvision's ResNet-18 (BatchNorm, residual blocks) on 32×32 images: one SGD step of batch 5 per client
    (client 1's 4 samples padded to 5), trained and evaluated in one cohort. One step only: BatchNorm over 4–5
    values at ResNet's 1×1 last stage is ill-conditioned, so float32 rounding grows step by step (two correct
    implementations drift apart by 1e-3 to 1e-1 within 2–4 steps, with padding or without)."""
    g = torch.Generator().manual_seed(0)
    clients = [
        ClientData(
            torch.randn(n, 3, 32, 32, generator=g),
            torch.randint(0, 4, (n,), generator=g),
            torch.randn(4, 3, 32, 32, generator=g),
            torch.randint(0, 4, (4,), generator=g),
        )
        for n in (7, 4, 5)
    ]
    data = FederatedData("images", clients, num_classes=4, input_shape=(3, 32, 32))
    torch.manual_seed(0)
    model = build_model("resnet18", data.input_shape, data.num_classes)
    context, _ = make_context(data, model=model, lr=0.01, momentum=0.5)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    tasks = [TrainTask(i, start, seed=i, steps=1) for i in range(3)]
    one_by_one, together = sequential(context), vectorized(context)
    trained = [one_by_one.train(tasks), together.train(tasks)]
    assert [r.samples_seen for r in trained[1]] == [r.samples_seen for r in trained[0]] == [5, 4, 5]
    for one, other in zip(*trained):
        assert one.loss == pytest.approx(other.loss, rel=1e-3)
        for key in one.params:
            torch.testing.assert_close(one.params[key], other.params[key], atol=1e-4, rtol=0)
    evals = [EvalTask(i, r.params) for i, r in enumerate(trained[0])]
    for one, other in zip(one_by_one.evaluate(evals), together.evaluate(evals)):
        assert one.correct == other.correct
        assert one.loss == pytest.approx(other.loss, rel=1e-3)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_masked_batch_norm_ignores_padding_and_updates_statistics_as_torch(momentum):
    """MaskedBatchNorm on 5 real rows + 3 padded rows (mask 0) = torch's BatchNorm2d on the 5 rows: output,
    gradients, and running mean/var (unbiased)/count after one training step, momentum or cumulative."""
    torch.manual_seed(0)
    norm = torch.nn.BatchNorm2d(3, momentum=momentum)
    norm.weight.data.uniform_(0.5, 1.5)
    norm.running_var.fill_(2.0)
    masked_norm = MaskedBatchNorm(copy.deepcopy(norm))
    x = torch.randn(5, 3, 4, 4, requires_grad=True)
    padded = torch.cat([x, 100 * torch.randn(3, 3, 4, 4)])
    expected = norm(x)
    with masked(masked_batch_norms(masked_norm), torch.tensor([1.0] * 5 + [0.0] * 3)) as statistics:
        out = masked_norm(padded)
    torch.testing.assert_close(out[:5], expected, atol=1e-5, rtol=0)
    (g_expected,) = torch.autograd.grad((expected * torch.arange(5.0).view(-1, 1, 1, 1)).sum(), x)
    (g_out,) = torch.autograd.grad((out[:5] * torch.arange(5.0).view(-1, 1, 1, 1)).sum(), x)
    torch.testing.assert_close(g_out, g_expected, atol=1e-5, rtol=0)
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(statistics[key], getattr(norm, key), atol=1e-6, rtol=0)
    assert torch.equal(masked_norm.running_mean, torch.zeros(3))  # reported, not written
