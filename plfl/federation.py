"""The federation loop: rounds, client sampling, method hooks, evaluation, callbacks.

Round numbering follows the reference code (PFLlib/FedALA): the evaluation
logged as round r comes after r completed rounds of training and
aggregation. Round 0 only initialises every client from the initial global
model and evaluates; rounds 1..R train the sampled clients, aggregate,
broadcast and evaluate. Evaluation uses each client's model right after its
local initialisation (``pre_local_init``) and before its local training, on
its own test split, as the reference code evaluates; with validation splits
(``data.val_fraction``) the same model also on its validation split.

A client whose local training raises, or returns NaN/Inf parameters, is
left out of its round's aggregation with a warning; a round fails when more
than ``federation.max_failed_clients`` of its clients fail (or all do). A
non-finite global model (``Method.global_params``) after aggregation stops
the run. ``state_dict``/``load_state_dict`` capture everything needed to
continue a run after its last finished round.

Unseen clients (``federation.unseen_clients``) are outside the federation: the
method, its store and the client sampling see only the participating clients,
ids ``0..N−1``; the unseen ones, ids ``N..N+U−1`` on the executor, never train,
send or count in an aggregation. At each evaluation every unseen client
receives ``Method.new_client_model``, fine-tuned on its own training split for
``eval.finetune_epochs`` epochs, and is tested on its test split; the model is
discarded after the test, so each evaluation is a fresh join.

Poisoned clients (``attack.*``, :mod:`plfl.attacks`): a malicious client's upload is changed after
``client_message`` by a model attack, relative to the message it received at the broadcast; clients.csv marks
the malicious clients (``malicious``) and the summary lists them (``malicious_clients``). With a backdoor,
every evaluation also tests each client's model on its triggered test images (``backdoor_success``).

Client-level DP (``privacy.level=client``, :mod:`plfl.privacy`): the method's mean of client models is DP-FedAvg's;
each round logs ``epsilon`` so far and the clip norm (``clip``), the summary the final ``epsilon``, its ``delta``
and the ``accountant``, and the checkpoint the clip norm and the rounds accounted (``privacy``). Sample-level DP
(``privacy.level=sample``): clients.csv gives each client's ``epsilon``, metrics.csv the largest (``epsilon_max``),
the summary the largest and mean with σ, δ and the accountant, and the checkpoint each client's accountant
history (``dp_sgd``).

The per-client work of each phase (training with ``post_train`` and ``client_message``, the broadcast's
``pre_local_init``, evaluation) goes to the clients' side (:mod:`plfl.client_side`): in this process through one
executor (:mod:`plfl.executors`), or on Flower's SuperNodes (:mod:`plfl.flower`); the loop keeps the server's books.
The server's message to a client is computed once per round, at the broadcast (``server_message``); the loop keeps
it for the clients that train in the next round and hands it to their ``local_train``.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence
from typing import Any, Optional

from plfl.activity import current as activity
from plfl.attacks import Attack
from plfl.callbacks.base import FederationCallback, RoundResult, RunInfo
from plfl.client_side import ClientSide, ClientUnreachable
from plfl.data.federated import ClientData
from plfl.errors import FederationError, PlflError, PlflWarning
from plfl.methods.base import FederationContext, Method, nbytes, numel
from plfl.metrics import federation_metrics, hurt_fraction, selected_round
from plfl.seeding import clients_per_round, global_rng_state, sample_clients, set_global_rng_state
from plfl.state import Params
from plfl.stopping import Stopped, deferred
from plfl.system import SystemSimulation
from plfl.tasks import ClientFailure, EvalResult, non_finite

CHECKPOINT_FORMAT = 2


class FederationLoop:
    """Runs ``rounds`` rounds of ``method`` over the clients in ``context``; the clients' training,
    local initialisation and evaluation go to ``clients`` (the clients' side: :class:`~plfl.client_side.LocalClients`
    runs them in this process; the unseen clients' fine-tuning needs it)."""

    def __init__(
        self,
        method: Method,
        context: FederationContext,
        clients: ClientSide,
        callbacks: list[FederationCallback],
        run: RunInfo,
        unseen: Sequence[ClientData] = (),
        finetune_epochs: int = 0,
        system: Optional[SystemSimulation] = None,
        attack: Optional[Attack] = None,
    ):
        self.method = method
        self.context = context
        self.clients = clients
        self.callbacks = callbacks
        self.run_info = run
        self.federation = context.federation
        self.history: list[RoundResult] = []
        self.best: Optional[tuple[float, int]] = None  # (accuracy, round)
        self.failures: list[dict[str, Any]] = []  # {round, client, reason} of every client left out
        self.received: dict[int, Optional[Params]] = {}  # the last broadcast's messages to the next round's clients
        self.unseen = list(unseen)  # the unseen clients' data: executor ids num_clients, num_clients + 1, ...
        self.finetune_epochs = finetune_epochs
        self.system = system  # simulated client systems (federation.system): dropout, deadline, simulated time
        self.attack = attack  # poisoned clients (attack.*): their uploads change after client_message

    @property
    def num_clients(self) -> int:
        return len(self.context.data.clients)

    def run(self) -> dict[str, Any]:
        """Run the rounds after the last finished one (0..R for a new run) and return the summary
        (see :meth:`summary`).

        Exceptions propagate after every callback's ``on_fit_error`` has seen a summary with the rounds
        finished so far and ``status: failed`` with the ``error``, or, for a run stopped by a signal
        (:class:`plfl.stopping.Stopped`, or ``KeyboardInterrupt``), ``status: interrupted`` with the
        ``signal``. A round's ``on_round_end`` (its files and checkpoint) completes before a signal takes
        effect.

        Raises:
            FederationError: a round with too many failed clients, or a non-finite global model.
            Stopped: the run was stopped; its ``run_dir`` and ``round`` (the last finished one) are set.
        """
        self.run_info = dataclasses.replace(self.run_info, history=list(self.history))
        self._emit("on_fit_start")
        start = self.history[-1].round + 1 if self.history else 0
        try:
            for round_ in range(start, self.federation.rounds + 1):
                self._emit("on_round_start", round_)
                result = self.run_round(round_)
                with deferred():
                    self.history.append(result)
                    self._emit("on_round_end", result)
        except (Stopped, KeyboardInterrupt) as error:
            summary = self.summary(status="interrupted")
            summary["signal"] = error.name if isinstance(error, Stopped) else "SIGINT"
            self._emit("on_fit_error", summary)
            if isinstance(error, Stopped):
                error.run_dir, error.round = self.run_info.run_dir, summary["rounds"]
            raise
        except BaseException as error:
            summary = self.summary(status="failed")
            summary["error"] = f"{type(error).__name__}: {error}"
            self._emit("on_fit_error", summary)
            raise
        summary = self.summary(status="completed")
        self._emit("on_fit_end", summary)
        return summary

    def run_round(self, round_: int) -> RoundResult:
        start = time.perf_counter()
        activity.start_round(round_)
        row: dict[str, Any] = {"round": round_}
        tables: dict[str, list[dict[str, Any]]] = {}
        if round_ > 0:
            trained, system_clients = self._train_and_aggregate(round_)
            row.update(trained)
            if system_clients:
                tables["system_clients"] = system_clients
        row.update(self._broadcast(round_))
        clients: list[dict[str, Any]] = []
        if round_ % self.federation.eval_every == 0 or round_ == self.federation.rounds:
            evaluated, clients = self._evaluate(round_)
            row.update(evaluated)
            if self.unseen:
                evaluated, tables["unseen_clients"] = self._evaluate_unseen(round_)
                row.update(evaluated, participation_gap=row["accuracy"] - evaluated["unseen_accuracy"])
        row.update(self.method.round_metrics(round_))
        if self.context.privacy is not None:
            row.update(self.context.privacy.round_metrics())
        if self.context.dp_sgd is not None:
            row.update(self.context.dp_sgd.round_metrics())
        if self.best is not None:
            row["best_accuracy"], row["best_round"] = self.best
        row["seconds"] = time.perf_counter() - start
        return RoundResult(round_, row, clients, {**self.method.round_tables(round_), **tables})

    def _train_and_aggregate(self, round_: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Local training of the sampled clients, then the server's aggregation of those that succeeded (with a
        system simulation: those that did not drop out and arrived by the deadline). Returns the round's metrics
        and, with a system simulation, a row per sampled client: its ``status`` (dropped, late, failed, partial or
        full),
        the training ``samples`` it processed and its simulated ``arrival`` (seconds after the broadcast)."""
        method, system = self.method, self.system
        activity.start_phase("training")
        sampled = sample_clients(self.federation.seed, round_, self.num_clients, self.federation.join_ratio)
        training = [c for c in sampled if system is None or not system.drops_out(c, round_)]
        down = {c: nbytes(self.received.get(c)) for c in training}
        messages, failed, late, arrivals, partial, loss_sum, samples = {}, [], [], [], 0, 0.0, 0
        timeline = [{"round": round_, "client": c, "status": "dropped", "samples": 0} for c in sampled if c not in down]
        budgets = {c: system.budget(c, down[c]) for c in training} if system is not None else {}
        updates = self.clients.train(round_, training, {c: self.received.get(c) for c in training}, budgets)
        for client_id, update in zip(training, updates):
            if isinstance(update, ClientFailure):
                failed.append({"round": round_, "client": client_id, "reason": update.reason})
                timeline.append({"round": round_, "client": client_id, "status": "failed", "samples": 0})
                continue
            result, message, processed, cut = update.result, update.message, update.processed, update.cut
            if result is None:  # left no mini-batch before the deadline
                late.append(client_id)
                timeline.append({"round": round_, "client": client_id, "status": "late", "samples": processed})
                continue
            if self.attack is not None:
                message = self.attack.message(method.name, client_id, message, self.received.get(client_id), round_)
            if system is not None:
                arrival = system.arrival(client_id, down[client_id], processed, nbytes(message))
                status = "late" if system.late(arrival) else "partial" if cut else "full"
                timeline.append(
                    {"round": round_, "client": client_id, "status": status, "samples": processed, "arrival": arrival}
                )
                if status == "late":  # what it trained stays on the client; its upload does not count
                    late.append(client_id)
                    continue
                arrivals.append(arrival)
                partial += cut
            messages[client_id] = message
            if result.samples_seen:
                loss_sum += result.loss * result.samples_seen
                samples += result.samples_seen
            self._emit("on_client_end", round_, client_id, result)
        self._check_failures(round_, len(training), failed)
        if messages:  # a round whose clients all dropped out or came late leaves the server as it was
            method.aggregate(messages, round_)
        bad = non_finite(method.global_params)
        if bad is not None:
            raise FederationError(
                f"Round {round_}: the global model holds NaN or Inf in {bad!r} after aggregation: the federation "
                f"diverged. Lower federation.lr (now {self.federation.lr}) and start again, or continue from the "
                "last good checkpoint with plfl fit --resume RUN_DIR federation.lr=..."
            )
        row = {
            "train_loss": loss_sum / samples if samples else float("nan"),
            "failed_clients": len(failed),
            "params_received": sum(numel(m) for m in messages.values()),
            "bytes_received": sum(nbytes(m) for m in messages.values()),
        }
        if system is None:
            return row, []
        row.update(dropped_clients=len(sampled) - len(training), late_clients=len(late), partial_clients=partial)
        if system.config.simulated:
            row["simulated_seconds"] = system.round_seconds(arrivals, len(messages) < len(sampled))
        return row, sorted(timeline, key=lambda r: r["client"])

    def _check_failures(self, round_: int, sampled: int, failed: list[dict[str, Any]]) -> None:
        """Warn about each failed client; raise FederationError when too many of the ``sampled`` clients that
        trained failed.

        Raises:
            FederationError: more than ``max_failed_clients`` failed, or all of them.
        """
        for f in failed:
            warnings.warn(
                PlflWarning(f"Round {round_}: client {f['client']} is left out of the aggregation: {f['reason']}."),
                stacklevel=2,
            )
        self.failures.extend(failed)
        limit = self.federation.max_failed_clients
        if (failed and len(failed) == sampled) or (limit is not None and len(failed) > limit):
            reasons = "; ".join(f"client {f['client']}: {f['reason']}" for f in failed)
            count = f"all {sampled}" if len(failed) == sampled else f"{len(failed)} of {sampled}"
            limit_text = "" if limit is None else f" (federation.max_failed_clients={limit})"
            raise FederationError(
                f"Round {round_}: {count} clients failed{limit_text}: {reasons}. Fix the cause (e.g. lower "
                "federation.lr if training diverged) and continue with plfl fit --resume RUN_DIR "
                "[federation.lr=...], or allow more failures with federation.max_failed_clients."
            )

    def _broadcast(self, round_: int) -> dict[str, int]:
        """Every client receives the server's message and initialises its model; the messages of the clients
        that train in the next round are kept for their training. Returns what was sent.

        Raises:
            FederationError: a client's local initialisation trained and failed.
        """
        params, size = 0, 0
        activity.start_phase("broadcast")
        trains_next = set(
            sample_clients(self.federation.seed, round_ + 1, self.num_clients, self.federation.join_ratio)
        )
        self.received, lost = {}, {}
        for group in self._groups():
            messages = {}
            for client_id in group:
                messages[client_id] = message = self.method.server_message(client_id, round_)
                params, size = params + numel(message), size + nbytes(message)
                if client_id in trains_next:
                    self.received[client_id] = message
            for client_id, failure in self.clients.initialise(round_, messages).items():
                if isinstance(failure, ClientUnreachable):
                    lost[client_id] = failure
                elif failure is not None:
                    raise FederationError(
                        f"Round {round_}: client {client_id}'s local initialisation "
                        f"(pre_local_init) failed: {failure.reason}. Fix the cause (e.g. lower "
                        "federation.lr if training diverged) and continue with plfl fit --resume "
                        "RUN_DIR [federation.lr=...]."
                    )
        if lost:  # their devices keep the model and the message they had before
            warn_unreachable(round_, "sent the server's message", lost)
            self.failures.extend({"round": round_, "client": c, "reason": f.reason} for c, f in lost.items())
        return {"params_sent": params, "bytes_sent": size}

    def _groups(self) -> list[range]:
        """The clients in the groups that the broadcast and the evaluation take one at a time: all together,
        or with ``federation.state_offload`` as many as a round trains, so that no more models than that are
        out of the store at once."""
        n = self.num_clients
        size = clients_per_round(n, self.federation.join_ratio) if self.federation.state_offload else n
        return [range(start, min(start + size, n)) for start in range(0, n, size)]

    def _evaluate(self, round_: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Every client's model on its test split and, with validation splits, on its validation split (the same
        model, the same metrics: ``val_accuracy`` and ``val_loss`` are :func:`federation_metrics`'
        ``accuracy`` and ``test_loss`` of the validation results), and the global model (if any) on every
        client's test split: ``global_accuracy`` and ``global_test_loss`` pooled over them, and
        :func:`~plfl.metrics.hurt_fraction`."""
        activity.start_phase("evaluation")
        validated = self.context.data.has_validation
        results, val_results, triggered, unreachable = {}, {}, [], {}
        for group in self._groups():
            results.update(zip(group, self.clients.evaluate(group, "test")))
            if validated:
                val_results.update(zip(group, self.clients.evaluate(group, "val")))
            if self.attack is not None and self.attack.config.kind == "backdoor":
                triggered.extend(self.clients.evaluate(group, "triggered"))
        for outcomes in (results, val_results):
            unreachable.update({i: r for i, r in outcomes.items() if isinstance(r, ClientUnreachable)})
        results = {i: r for i, r in results.items() if i not in unreachable}
        val_results = {i: r for i, r in val_results.items() if i not in unreachable}
        sizes = {i: c.num_samples for i, c in enumerate(self.context.data.clients)}
        metrics = federation_metrics(results, sizes)
        if validated:
            val = federation_metrics(val_results, sizes)
            metrics.update(val_accuracy=val["accuracy"], val_loss=val["test_loss"])
        if triggered:  # the share of triggered test images of the other classes predicted as the target
            total = sum(r.total for r in triggered)
            metrics["backdoor_success"] = sum(r.correct for r in triggered) / total if total else float("nan")
        global_model = self.method.global_model(round_)
        global_results = {}
        if global_model is not None:
            evaluated = self.clients.evaluate_models(list(results), [global_model] * len(results))
            unreachable.update({i: r for i, r in zip(results, evaluated) if isinstance(r, ClientUnreachable)})
            global_results = {i: r for i, r in zip(results, evaluated) if i not in unreachable}
            pooled = federation_metrics(global_results, sizes)
            metrics.update(
                global_accuracy=pooled["accuracy"],
                global_test_loss=pooled["test_loss"],
                personalization_hurt_fraction=hurt_fraction(
                    {i: r for i, r in results.items() if i in global_results}, global_results
                ),
            )
        if unreachable:  # clients whose devices did not answer (plfl.flower): the others' metrics
            metrics["unreachable_clients"] = len(unreachable)
            warn_unreachable(round_, "evaluated", unreachable)
        if self.best is None or metrics["accuracy"] > self.best[0]:
            self.best = (metrics["accuracy"], round_)
        rows = []
        for i, r in results.items():
            if i in unreachable:
                continue
            row = client_result_row(round_, i, r)
            if validated:
                v = val_results[i]
                row.update(num_val=v.total, val_correct=v.correct, val_accuracy=v.accuracy, val_loss=v.loss)
            if global_results:
                row.update(global_correct=global_results[i].correct, global_accuracy=global_results[i].accuracy)
            if self.attack is not None:
                row["malicious"] = i in self.attack.malicious
            if self.context.dp_sgd is not None:
                row["epsilon"] = self.context.dp_sgd.epsilon(i)
            rows.append(row)
        return metrics, rows

    def _evaluate_unseen(self, round_: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """The unseen clients' models (:meth:`Method.new_client_model`, fine-tuned for ``eval.finetune_epochs``
        epochs) on their test splits: :func:`federation_metrics` of them, each key prefixed ``unseen_``, and a
        row per client.

        Raises:
            FederationError: an unseen client's fine-tuning failed (raised, or diverged).
        """
        activity.start_phase("unseen clients")
        model = self.method.new_client_model(round_)
        ids = range(self.num_clients, self.num_clients + len(self.unseen))
        models = self.clients.fine_tune(round_, ids, model, self.finetune_epochs)
        for client_id, joined in zip(ids, models):
            if isinstance(joined, ClientFailure):
                raise FederationError(
                    f"Round {round_}: unseen client {client_id}'s fine-tuning (eval.finetune_epochs="
                    f"{self.finetune_epochs}) failed: {joined.reason}. Lower eval.finetune_epochs or "
                    "federation.lr and continue with plfl fit --resume RUN_DIR [eval.finetune_epochs=...]."
                )
        results = dict(zip(ids, self.clients.evaluate_models(ids, models)))
        metrics = federation_metrics(results, {i: c.num_samples for i, c in zip(ids, self.unseen)})
        rows = [client_result_row(round_, i, r) for i, r in results.items()]
        return {f"unseen_{key}": value for key, value in metrics.items()}, rows

    def summary(self, status: str) -> dict[str, Any]:
        """Best and final metrics and per-round costs of the rounds run so far.

        With validation splits, ``selected_accuracy`` is the test accuracy at ``selected_round``, the evaluated
        round of the highest ``val_accuracy`` (:func:`~plfl.metrics.selected_round`; pFL-Bench's rule);
        ``best_accuracy`` at ``best_round`` is the highest test accuracy (PFLlib's rule, optimistic: the test
        data choose the round). Both come from the finished rounds alone, so a resumed run reports what an
        uninterrupted one does. With unseen clients, ``{best,selected,final}_unseen_accuracy`` and
        ``..._participation_gap`` (participating minus unseen accuracy, pFL-Bench's gap) are taken at each of
        those rounds.

        ``seconds_per_round`` and ``params_{sent,received}_per_round`` are means
        over the training rounds 1..R (round 0 alone when no round trained); with a system simulation, so is
        ``simulated_seconds_per_round``, and ``dropped_clients``, ``late_clients`` and ``partial_clients`` count
        client-rounds over all rounds.
        """
        trained = [r.metrics for r in self.history if r.round > 0] or [r.metrics for r in self.history]
        evaluated = [r.metrics for r in self.history if "accuracy" in r.metrics]

        def mean(key: str) -> Optional[float]:
            return sum(m.get(key, 0) for m in trained) / len(trained) if trained else None

        selected: dict[str, Any] = {}
        if self.context.data.has_validation:
            chosen = selected_round(evaluated)
            selected = {
                "selected_accuracy": chosen[1] if chosen else None,
                "selected_round": chosen[0] if chosen else None,
            }
        summary = {
            "status": status,
            "method": self.method.name,
            "rounds": self.history[-1].round if self.history else None,
            **selected,
            "best_accuracy": self.best[0] if self.best else None,
            "best_round": self.best[1] if self.best else None,
            "final_accuracy": evaluated[-1]["accuracy"] if evaluated else None,
            "final_round": evaluated[-1]["round"] if evaluated else None,
            # Self-FL's Table 1 columns at the final round (plfl.metrics.federation_metrics).
            "final_worst10_accuracy": evaluated[-1]["worst10_accuracy"] if evaluated else None,
            "final_largest10_accuracy": evaluated[-1]["largest10_accuracy"] if evaluated else None,
            "seconds_per_round": mean("seconds"),
            "total_seconds": sum(r.metrics["seconds"] for r in self.history),
            "params_sent_per_round": mean("params_sent"),
            "params_received_per_round": mean("params_received"),
            "bytes_sent_per_round": mean("bytes_sent"),
            "bytes_received_per_round": mean("bytes_received"),
            "num_clients": self.num_clients,
            "num_parameters": self.run_info.num_parameters,
            "client_failures": self.failures,  # {round, client, reason}; metrics.csv counts them per round
        }
        if self.context.privacy is not None:
            summary.update(self.context.privacy.summary())
        if self.context.dp_sgd is not None:
            summary.update(self.context.dp_sgd.summary(self.num_clients))
        if self.attack is not None:
            summary["malicious_clients"] = sorted(self.attack.malicious)
        if self.attack is not None and self.attack.config.kind == "backdoor":
            summary["final_backdoor_success"] = evaluated[-1]["backdoor_success"] if evaluated else None
        if self.system is not None:
            for key in ("dropped_clients", "late_clients", "partial_clients"):  # client-rounds, all rounds
                summary[key] = sum(r.metrics.get(key, 0) for r in self.history)
            if self.system.config.simulated:
                summary["simulated_seconds_per_round"] = mean("simulated_seconds")
                summary["total_simulated_seconds"] = sum(r.metrics.get("simulated_seconds", 0) for r in self.history)
        if self.unseen:
            summary["num_unseen_clients"] = len(self.unseen)
            by_round = {m["round"]: m for m in evaluated}
            for rule in ("best", "selected", "final"):
                if f"{rule}_round" not in summary:
                    continue
                row = by_round.get(summary.get(f"{rule}_round"))
                summary[f"{rule}_unseen_accuracy"] = row["unseen_accuracy"] if row else None
                summary[f"{rule}_participation_gap"] = row["participation_gap"] if row else None
        return summary

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue after the last finished round: the finished rounds' results,
        the method's server state, the client-state store and the global RNGs (see plfl.checkpoint)."""
        return {
            "format": CHECKPOINT_FORMAT,
            "round": self.history[-1].round if self.history else None,
            "history": [dataclasses.asdict(r) for r in self.history],
            "best": self.best,
            "failures": self.failures,
            "method": self.method.state_dict(),
            "store": self.context.store.state_dict(),
            "received": self.received,
            "rng": global_rng_state(),
            **({"privacy": self.context.privacy.state_dict()} if self.context.privacy is not None else {}),
            **({"dp_sgd": self.context.dp_sgd.state_dict()} if self.context.dp_sgd is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (see :meth:`state_dict`); :meth:`run` then starts at the next round.

        Raises:
            PlflError: ``state`` was saved in another format.
        """
        if state.get("format") != CHECKPOINT_FORMAT:
            raise PlflError(
                f"The checkpoint has format {state.get('format')!r}; this plfl reads format "
                f"{CHECKPOINT_FORMAT}. Resume it with the plfl version that wrote it."
            )
        self.history = [RoundResult(**r) for r in state["history"]]
        self.best = state["best"]
        self.failures = state["failures"]
        self.method.load_state_dict(state["method"])
        self.context.store.load_state_dict(state["store"])
        self.received = state["received"]
        if self.context.privacy is not None:
            self.context.privacy.load_state_dict(state["privacy"])
        if self.context.dp_sgd is not None:
            self.context.dp_sgd.load_state_dict(state["dp_sgd"])
        set_global_rng_state(state["rng"])

    def _emit(self, hook: str, *args: Any) -> None:
        """Call ``hook`` of every callback with the run and ``args``."""
        for callback in self.callbacks:
            getattr(callback, hook)(self.run_info, *args)


def warn_unreachable(round_: int, what: str, clients: dict[int, ClientUnreachable]) -> None:
    """Warn that ``clients`` could not be ``what`` in ``round_``, each with its reason."""
    reasons = "; ".join(f"client {c}: {f.reason}" for c, f in sorted(clients.items()))
    warnings.warn(PlflWarning(f"Round {round_}: {len(clients)} clients could not be {what}: {reasons}."), stacklevel=3)


def client_result_row(round_: int, client_id: int, result: EvalResult) -> dict[str, Any]:
    """A client's test result as a clients.csv (or unseen_clients.csv) row."""
    return {
        "round": round_,
        "client": client_id,
        "num_test": result.total,
        "correct": result.correct,
        "accuracy": result.accuracy,
        "test_loss": result.loss,
    }
