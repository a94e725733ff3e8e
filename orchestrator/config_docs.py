"""The config reference (docs/config.md), generated from the pydantic ``JobConfig`` schema.

``python -m islands.orchestrator.config_docs > docs/config.md`` regenerates the page; a unit test
checks that the committed page equals ``render_markdown()``. Every field is listed with its dotted
path, type, default and constraints. Its text is the field's own ``description=`` when it has
one (a one-word description is a symbol, such as "P", and the note below follows it); otherwise
it comes from ``FIELD_NOTES`` here. Cross-field rules that live in validators are listed in
``RULES``. The output depends on nothing but the schema and this module, so it is deterministic.
"""

from __future__ import annotations

import re
import sys
import types
import typing
from typing import Any, Iterator, NamedTuple, Optional

import annotated_types
import yaml
from pydantic import BaseModel

from .config import REGION_NAME, JobConfig

GENERATE_COMMAND = "python -m islands.orchestrator.config_docs > docs/config.md"

# Keys: the dotted path ("syncer.fragments"; "regions.<name>.learners" inside a mapping,
# "chaos.events[].target" inside a list); "path@tag" for one variant of a tagged union.
FIELD_NOTES: dict[str, str] = {
    "name": "Job name: fills `{name}` in `run.run_dir` and names the job in logs.",
    "seed": "Seed of the model's initial parameters and of every learner's batch order.",
    "task": "What the learners train: a task factory by import path (docs/tasks.md). The "
            "default is the built-in byte LM, whose arguments are `model` and `data`.",
    "task.path": "`package.module:factory`, imported inside each learner (ship your module with "
                 "`ray job submit --working-dir` or `runtime_env: {py_modules: [...]}`). "
                 "`islands.tasks.bytelm:task` is the built-in byte LM; "
                 "`islands.tasks.flax_lm:task` the Flax + Grain reference task.",
    "task.args": "Keyword arguments of the factory (any YAML values). Empty for the built-in "
                 "task, which reads `model` and `data`.",
    "model": "The built-in task's model (ignored by another `task.path`).",
    "data": "The built-in task's data (ignored by another `task.path`).",
    "learner": "What every learner does between syncs.",
    "syncer": "Fragments, schedule, merge and outer optimizer.",
    "quorum": "When a fragment may merge.",
    "compression": "How a learner encodes its drift before pushing it. Default: "
                   "`{type: nf2, block_size: 64}` (2 bits a value; chosen by a 1 000-step, "
                   "3-seed run on the default LM and the Flax task against int4 pushes with fp32 "
                   "replies: see BENCHMARKS.md).",
    "downlink_compression": "How the syncer encodes its answer to a merged push: `none` sends "
                            "the merged fragment in fp32; any other codec sends the encoded "
                            "difference to the copy the syncer records for that learner (a "
                            "shadow), so both ends hold the same bits. Default: "
                            "`{type: nf2, block_size: 256}`, for remote regions too (the "
                            "codes cross the link; with `link.premerge` a region's learners "
                            "that merged together share one shadow and one reply).",
    "regions": "The regions and their learners, by region name.",
    "health": "Failure detection and the restart policy.",
    "metrics": "The Prometheus endpoint.",
    "console": "The operator console: a web page served by the controller (docs/operations.md"
               "#the-console).",
    "console.enabled": "Serve the console from the controller; `islands run` prints its address.",
    "console.port": "Port of the console; 0 picks a free port (printed at start).",
    "console.host": "Address the console binds. Loopback by default: reach it through an SSH "
                    "tunnel or `kubectl port-forward`; bind another address only behind a "
                    "network you trust (its pages are readable without the token).",
    "console.allow_chaos": "Offer chaos actions (kill, hang, slow down, lose a region, kill the "
                           "syncer) on the console. Scale, drain, restart, pause and resume are "
                           "always offered.",
    "console.token_file": "A file holding the token every console action must carry (a mounted "
                          "Kubernetes secret). null: `$ISLANDS_CONSOLE_TOKEN`, else the Ray "
                          "cluster's auth token (`$RAY_AUTH_TOKEN`, `$RAY_AUTH_TOKEN_PATH`, "
                          "`~/.ray/auth_token`) when Ray's token auth is on, else a token "
                          "generated for the job in `RUN_DIR/console_token` (mode 0600).",
    "chaos": "A seeded fault plan; leave it out (null) for none.",
    "run": "Duration and outputs of `islands run`.",
    # model
    "model.vocab_size": "Vocabulary size; 256 is one token per byte (the byte-level corpus).",
    "model.d_model": "Width of the residual stream.",
    "model.n_layers": "Number of transformer blocks.",
    "model.n_heads": "Attention heads per block.",
    "model.d_ff": "Hidden width of each block's MLP.",
    "model.seq_len": "Tokens per training window (and rows of the position embedding).",
    "model.compute_dtype": "Dtype of the forward pass's matmuls: `bfloat16` casts weights and "
                           "activations to bf16 for them (mixed precision) while the params, "
                           "gradients, inner optimizer state and everything the syncer sees stay "
                           "`float32`, as do the norms, the softmax, the logits and the loss "
                           "(docs/tasks.md#mixed-precision). `float32` runs the unchanged fp32 "
                           "model.",
    # data
    "data.corpus": "`stdlib` (the Python standard library's own `.py` sources, present wherever "
                   "Python is; no network) or a directory whose `.py` files are the corpus.",
    "data.eval_fraction": "Share of files held out for evaluation, chosen by a hash of each "
                          "file's path (the same split in every process).",
    "data.max_bytes": "Caps the training bytes (evaluation at max(max_bytes // 20, 4096)); "
                      "null reads everything.",
    "data.batch_size": "Windows per inner step of one learner; tokens per step = batch_size × "
                       "`model.seq_len`.",
    "data.eval_batches": "Held-out batches per evaluation of the global parameters.",
    # learner
    "learner.inner_optimizer": "The inner optimizer: global-norm clipping, then AdamW on a "
                               "linear warmup and cosine decay.",
    "learner.inner_optimizer.lr": "Peak learning rate of the inner AdamW.",
    "learner.inner_optimizer.warmup_steps": "Steps of linear warmup from 0 to `lr`.",
    "learner.inner_optimizer.total_steps": "Step at which the cosine decay reaches lr/10 (the "
                                           "warmup included); the rate stays at lr/10 after.",
    "learner.inner_optimizer.weight_decay": "Decoupled weight decay, applied to tensors of rank "
                                            "≥ 2 only (not to norm scales).",
    "learner.inner_optimizer.b1": "Adam's first-moment decay rate.",
    "learner.inner_optimizer.b2": "Adam's second-moment decay rate.",
    "learner.inner_optimizer.clip_norm": "Gradients are rescaled to at most this global L2 norm.",
    "learner.overlap": "What a learner does with the steps it took between a push and the "
                       "adoption of its merge (τ or more: a reply that arrives late is adopted "
                       "late): `carry` keeps them (θ ← Θ + (θ_now − θ_at_push), they go out with "
                       "the next push, no token is dropped); `blend` mixes (see merge_alpha; "
                       "with α = 0 the merged fragment overwrites them: the paper's rule).",
    "learner.merge_alpha": "With overlap: blend, α of the blend when a merged fragment arrives: "
                           "θ ← α·θ_local + (1 − α)·Θ; 0 adopts the merged fragment as it is "
                           "(the paper) and the τ steps are dropped.",
    "learner.min_step_time_s": "Pads every inner step to at least this many seconds divided by "
                               "the learner's speed factor: emulates slower hardware. 0: no "
                               "padding.",
    "learner.sharding": "How a learner lays its parameters and inner optimizer state over the "
                        "devices its process sees (one SPMD program; the batch is always split "
                        "by rows over them, so `data.batch_size` must divide by the device "
                        "count): `replicated` keeps a whole copy on every device; `fsdp` slices "
                        "each tensor over the devices (the task's `partition_specs` when it "
                        "gives them, otherwise along its largest axis the device count divides). "
                        "A learner on one device runs unsharded either way.",
    "learner.eval_every_s": "Seconds between two evaluations of the global parameters on the "
                            "held-out batches (`islands_eval_loss`).",
    # syncer
    "syncer.fragments": "number of fragments the parameters are split into (whole tensors, "
                        "balanced by size); 1/P of the model crosses the network per sync.",
    "syncer.sync_every_steps": "inner steps between two syncs of the same fragment; fragment p "
                               "is due after step t when t mod H = ⌊p·H/P⌋.",
    "syncer.outer_optimizer": "The outer optimizer, applied per fragment to the merged outer "
                              "gradient.",
    "syncer.outer_optimizer.type": "Which outer optimizer.",
    "syncer.outer_optimizer.lr": "Outer learning rate.",
    "syncer.outer_optimizer.lr@nesterov": "Outer learning rate; unset: by the rule for H "
                                          "(1.0 up to H = 128, DiLoCo's 0.7 from H = 512, "
                                          "log-linear between; docs/tuning.md).",
    "syncer.outer_optimizer.momentum@nesterov": "Nesterov momentum; unset: by the rule for H (0 "
                                                "up to H = 128, 0.9 from H = 512; "
                                                "docs/tuning.md).",
    "syncer.outer_optimizer.momentum@sgd": "Heavy-ball momentum; 0 is none. `{type: sgd, lr: "
                                           "1.0}` makes Θ the weighted mean of the learners.",
    "syncer.outer_optimizer.b1": "Adam's first-moment decay rate.",
    "syncer.outer_optimizer.b2": "Adam's second-moment decay rate.",
    "syncer.history_versions": "Versions of each fragment the syncer keeps to rebuild pushes "
                               "made against an older base; a push whose base is older is "
                               "refused (`unknown_version`).",
    "syncer.max_staleness": "Refuse a push whose base is more than this many versions behind "
                            "(`too_stale`); null: no limit.",
    "syncer.outlier_norm_factor": "Refuse a push whose drift norm exceeds this factor × the "
                                  "median norm of the fragment's recent pushes (at least 3 of "
                                  "them; `outlier_norm`); null turns the test off.",
    "syncer.staleness_discount": "Extra weight (1 + staleness)^−discount on each contribution; 0 "
                                 "(the paper) leaves the token weights alone.",
    "syncer.merge_rule": "`rda`: radial-directional average for every tensor but the embeddings, "
                         "which always take the weighted mean; `mean`: weighted mean for every "
                         "tensor.",
    "syncer.participation_scale": "Scale each merge's outer gradient by n/M (n learners in the "
                                  "merge, M registered learners), so that with K < M one round "
                                  "of every learner adds up to one synchronous-sized outer step.",
    "syncer.outer_gradient": "Where a push's outer gradient is taken from "
                             "(docs/architecture.md#asynchrony-stale-and-partial-merges): "
                             "`pull`, Θ − (base + δ), pulls Θ towards the learner's model, so "
                             "a stale push takes back part of the merges since its base; "
                             "`rebased`, Θ(v_base) − (base + δ), applies the push's own drift "
                             "to today's Θ. The same at staleness 0.",
    "syncer.round_step": "`per_merge`: every partial merge of a round (K < M) steps the outer "
                         "optimizer with its share n/M; `per_round`: the later pushes of a "
                         "round join its step, taken again from the round's start with every "
                         "push in so far (one outer step and one momentum update per round).",
    "syncer.staleness_share": "Exponent d: each push counts (1 + staleness)^−d of a learner in "
                              "a merge's share of an outer step, so a stale push moves Θ less "
                              "also when it is merged alone; 0: the share is n/M.",
    "syncer.schedule_clock": "What the learners' inner learning-rate schedule runs on: "
                             "`learner`, each learner's own step count; `fleet`, the fleet's "
                             "progress (the mean step of the live learners' newest merged "
                             "pushes, sent with every merge), so a learner that restarts, lags "
                             "or runs fast neither replays nor skips the schedule.",
    "syncer.round_wait": "The round-completion wait, a share of a sync period: a partial merge "
                         "(K < M) is held past the grace window for the round's missing live "
                         "learners predicted to push within this share of the waiting "
                         "pushers' period (each learner's last push of the fragment plus "
                         "whole periods, its period the average time between two pushes of "
                         "one fragment; plus the grace window as margin). Learners do not "
                         "wait: the reply is later. 0: the grace window alone.",
    "syncer.snapshot_every_merges": "Snapshot the syncer (Θ, outer state, versions, epoch, "
                                    "ledger) once this many merges were made since the last "
                                    "snapshot (and `syncer.snapshot_min_interval_s` has passed).",
    "syncer.snapshot_min_interval_s": "Seconds at least between two snapshots. A snapshot writes "
                                      "every fragment on the syncer's loop, which then merges "
                                      "nothing: at a merge every few seconds (a real model), one "
                                      "every 10 merges took a measurable share of the learners' "
                                      "time. Default: 30 with `syncer.journal` on (a restart "
                                      "loses no merge either way: the journal holds each "
                                      "fragment's newest state), 0 with it off (the snapshot is "
                                      "then all a restart has).",
    "syncer.journal": "Write each merged fragment (with its outer state and the ledger) to the "
                      "snapshot directory before the merge is answered, so a restarted syncer "
                      "loses no merged version between snapshots (one file per fragment, "
                      "replaced in place).",
    "syncer.checkpoint_dir": "Where the syncer's snapshots go: `<checkpoint_dir>/<job name>`; "
                             "null: `<run dir>/syncer`. Nothing there is ever deleted: a new job "
                             "refuses a directory that already holds snapshots, `islands run "
                             "--resume` continues from them.",
    # quorum
    "quorum.min_learners": "distinct learners whose pushes for a fragment must be in before it "
                           "may merge.",
    "quorum.grace_gamma": "γ: the share of the slack given to stragglers once the quorum is in "
                          "(the grace window).",
    "quorum.grace_cap_s": "Upper bound of the grace window, seconds.",
    # compression
    "compression.type": "Which codec: fp32 (`none`), bfloat16, blockwise absmax "
                        "int8/int4/int2 (int2: four levels ±A, ±A/3 per block of absmax A), or "
                        "`nf2`: 2 bits with the Lloyd-Max levels of a normal, ±c, ±0.30c per "
                        "block, c fitted to the block (≈ 1.5 × its RMS) and stored as bfloat16; "
                        "values beyond ±c are clipped (error feedback carries the rest).",
    "compression.error_feedback": "Keep what each encoding left out and add it to the next push "
                                  "of the same fragment.",
    "compression.block_size": "Elements per scale (float32; bfloat16 for nf2).",
    "downlink_compression.type": "The downlink codec (the kinds of `compression.type`).",
    "downlink_compression.error_feedback": "Encode the difference to what the learner holds, so "
                                           "what one update left out goes with the next; false: "
                                           "the difference to the global fragment of the "
                                           "learner's version.",
    "downlink_compression.block_size": "Elements per scale (float32; bfloat16 for nf2). For "
                                       "nf2 it defaults to 256 (written out or not), for the "
                                       "others to 64.",
    "syncer.downlink_max_shadows": "With an encoded downlink, the most shadows (the syncer's "
                                    "copy of what a learner holds) kept per fragment; learners "
                                    "at one base share one. null (the default): no bound, so a "
                                    "learner whose copy diverged from the others' still gets "
                                    "encoded replies, at one fragment copy of syncer memory each. "
                                    "A bound caps that memory; the learners past it get the "
                                    "full fp32 fragment instead (about 16x the bytes of nf2).",
    "syncer.downlink_full_after_versions": "With an encoded downlink, a learner whose copy is "
                                           "more than this many versions behind the merge gets "
                                           "the full fragment instead; null: never for that "
                                           "reason.",
    # regions
    "regions.<name>": "One region.",
    "regions.<name>.learners": "Learners in the region at start; each takes one unit of the Ray "
                               "resource `region:<name>`.",
    "regions.<name>.max_learners": "Upper bound for `islands scale` and for growth when the "
                                   "cluster gains `region:<name>` capacity; also sizes the "
                                   "embedded cluster's resource. null: `learners` (the region "
                                   "does not grow).",
    "regions.<name>.speed_factors": "Relative speed of the learners (one number for all, or one "
                                    "per learner); a learner with factor f pads its steps to "
                                    "`learner.min_step_time_s` / f and is never called a "
                                    "straggler when f < 1.",
    "regions.<name>.bandwidth_gbps": "Emulated bandwidth of the region's link to the syncer, "
                                     "Gbit/s: b bytes take latency + b / bandwidth on top of "
                                     "the real network. null or 0 (the default): no emulated "
                                     "cap. For trials on one machine (the demo sets it); leave "
                                     "it out on a real cluster.",
    "regions.<name>.latency_ms": "Emulated one-way latency of the region's link to the syncer, "
                                 "on top of the real network; 0 (the default): none.",
    # a region's hardware (docs/accelerators.md)
    "regions.<name>.accelerator": "What each learner runs on; Ray reserves its devices. `cpu` "
                                  "learners run JAX on the CPU; `gpu` and `tpu` learners let "
                                  "JAX pick the GPUs or TPU chips Ray assigned them "
                                  "(docs/accelerators.md).",
    "regions.<name>.devices_per_host": "Devices one learner uses: GPUs (below 1 shares a GPU, "
                                       "e.g. 0.25 for four learners per GPU), TPU chips, or for "
                                       "`cpu` N virtual CPU devices "
                                       "(`--xla_force_host_platform_device_count`). null: 1, "
                                       "or every chip of a TPU host.",
    "regions.<name>.hosts_per_learner": "Hosts one learner unit spans: one process per host, "
                                        "placed as a gang and joined by `jax.distributed` "
                                        "(docs/accelerators.md#multi-host-units). null: 1, or "
                                        "for `tpu` the topology's hosts.",
    "regions.<name>.tpu_type": "TPU generation of an `accelerator: tpu` region: `v4`, `v5e`, "
                               "`v5p` or `v6e`.",
    "regions.<name>.topology": "TPU slice topology of an `accelerator: tpu` region, e.g. "
                               "`2x2x1` (v4, v5p) or `2x4` (v5e, v6e); its chips and hosts "
                               "follow from the table in docs/accelerators.md.",
    # health
    "health.heartbeat_s": "Seconds between two heartbeats of a learner to the controller.",
    "health.timeout_s": "A learner with no heartbeat for this long is hung: it is killed and "
                        "restarted (cause `hang`). A draining learner waits at most this long "
                        "for its in-flight pushes' answers, then leaves; one still draining "
                        "twice this long after its drain began is ended, what it held dropped "
                        "as `drain_timeout`.",
    "health.straggler_factor": "A learner whose own step time (this incarnation's, after its "
                               "first step) exceeds this × the median of its region's other "
                               "learners (at least two) for `straggler_window_s` is a straggler: "
                               "it is restarted once (cause `straggler`); slow again after that, "
                               "it trains on at its pace (event `learner_slow_tolerated`).",
    "health.spares": "Warm spare learner processes kept per region (an int for every region, "
                     "or {region: n}): each has imported JAX, built the task, compiled the step "
                     "and found the syncer, and takes a failed (or new) learner's place at once. "
                     "Each holds a learner's resources (its `region:<name>` unit and devices). "
                     "A remote region's agent keeps that region's spares in its own cluster.",
    "health.spare_wait_s": "A restart that falls due (its backoff and any repair over) while "
                           "its region's spare is still preparing waits at most this many "
                           "seconds for that spare, rather than start a new process beside it "
                           "(which would slow both): the spare then prepares at normal priority "
                           "(hurried), and a promoted spare's start costs a few hundredths of a "
                           "CPU-second, a new process's about 2.4 on a CPU host "
                           "(benchmarks/start_cost.py). One waiting restart per preparing "
                           "spare, the earliest due first; 0: never wait. "
                           "docs/architecture.md#warm-spares.",
    "health.prestart_restarts": "When a learner fails and its restart must wait (the backoff, a "
                                "repair time) with no ready spare, its next process starts at "
                                "once as a spare reserved for it, on the resources the failed "
                                "process freed: it prepares (JAX, the task, the compiled step) "
                                "while the restart waits and is promoted when the restart is "
                                "due, so the start then costs a promotion, not a new process's "
                                "CPU-seconds. Not for units of several hosts. "
                                "docs/architecture.md#warm-spares.",
    "health.straggler_window_s": "Seconds a learner must stay slow before it is called a "
                                 "straggler (a moment of slowness is timing noise).",
    "health.straggler_min_excess_s": "Slow also means at least this many seconds above the "
                                     "peers' median step: 4× a millisecond step is noise.",
    "health.restart": "Restart policy: exponential backoff, a budget per cause.",
    "health.restart.backoff_initial_s": "Delay before a learner's first restart.",
    "health.restart.backoff_multiplier": "Growth of the delay: min(initial × multiplier^n, max) "
                                         "with n the learner's counted crash restarts (crashes, "
                                         "hangs, quarantines; planned handovers, stragglers and "
                                         "preemptions never lengthen it).",
    "health.restart.backoff_max_s": "Upper bound of the delay.",
    "health.restart.max_crash_restarts": "Restarts per learner for crashes, hangs and "
                                         "quarantines together; null: unlimited. Over budget the "
                                         "learner is retired. Being slow never spends it.",
    "health.restart.max_preemption_restarts": "Restarts per learner after preemptions (its node "
                                              "went away); null: unlimited.",
    "health.restart.reset_after_s": "A learner that trained this long since its last restart "
                                    "(paused time left out) was healthy: the restarts before "
                                    "count no more, in the budgets or the backoff; null: they "
                                    "count for the learner's lifetime. Must be > 0; keep it "
                                    "longer than the time a deterministic failure takes to "
                                    "come back, or such a learner restarts forever "
                                    "(Kubernetes resets a crash backoff after 10 minutes).",
    "health.restart.crash_loop_after": "A learner whose crashes came this many times with the "
                                       "same error at one resume step, or within "
                                       "`crash_loop_window_steps` steps of it, is retired as "
                                       "`crash_loop` (the event names the step and the error), "
                                       "whatever budget it has left; chaos kills, hangs, "
                                       "start-up timeouts and device mismatches never count; "
                                       "null: never.",
    "health.restart.crash_loop_window_steps": "How close (in steps) resume steps of the same "
                                              "error count as one place for "
                                              "`crash_loop_after`; 0: only the same step.",
    "health.placement_timeout_s": "Seconds to wait for the syncer to start (also after a syncer "
                                  "restart) before giving up.",
    # metrics
    "learner.profiler": "Each learner starts a JAX profiler server on a free port "
                        "(`jax.profiler.start_server`) where the platform allows; its address is "
                        "in the learner's heartbeat and on the console. Off by default: the "
                        "server costs a thread and a port per learner.",
    "metrics.enabled": "Serve Prometheus `/metrics` from the controller.",
    "metrics.port": "Port of `/metrics`; 0 picks a free port (printed at start).",
    "metrics.host": "Address `/metrics` binds; null: 127.0.0.1 for an embedded cluster, the "
                    "controller node's address on a real cluster. `0.0.0.0` (every interface) "
                    "only when set.",
    "metrics.snapshot_every_s": "Seconds between rows of the run dir's `metrics.jsonl` (a "
                                "snapshot of every exported value).",
    "metrics.goodput_window_s": "Length of the sliding goodput window; it names the `window` "
                                "label: 300 → `5m`, 30 → `30s`.",
    # chaos
    "chaos.seed": "Seed of the random faults; the same seed gives the same faults.",
    "chaos.events": "Scripted faults, at fixed times.",
    "chaos.mtbf_s": "Mean time between failures of each learner, seconds of up time; null: no "
                    "random learner kills.",
    "chaos.repair_s": "Repair delay after a random learner kill or region loss: no restart "
                      "before it is over.",
    "chaos.kill_mode": "How random learner kills happen: `ray_kill`, or `exit` (a hard process "
                       "exit inside the learner).",
    "chaos.region_mtbf_s": "Mean time between losses of a whole region, per region; null: none.",
    "chaos.slowdown_mtbf_s": "Mean time between slowdowns, per learner; null: none.",
    "chaos.slowdown_factor": "Step-time multiplier of a random slowdown.",
    "chaos.slowdown_s": "Duration of a random slowdown, seconds.",
    "chaos.network_mtbf_s": "Mean time between network faults (200 ms extra latency, a 0.1 Gbit/s "
                            "cap), per region; null: none.",
    "chaos.network_s": "Duration of a random network fault, seconds.",
    "chaos.syncer_mtbf_s": "Mean time between syncer kills; null: none.",
    "chaos.horizon_s": "Random faults are drawn on [0, horizon_s) from the job's start; null: "
                       "`run.duration_s`.",
    "chaos.events[]": "One scripted fault.",
    "chaos.events[].type": "What happens.",
    "chaos.events[].target@kill": "The learner (`<region>:<i>`) or `syncer`.",
    "chaos.events[].target@region_loss": "The region.",
    "chaos.events[].target@slowdown": "A learner (`<region>:<i>`) or a region (all its "
                                      "learners).",
    "chaos.events[].target@network": "The region; a `partition` may also target `@home` (every "
                                      "remote region's link: the home's network fails).",
    "chaos.events[].at_s": "When, seconds from the job's start.",
    "chaos.events[].mode": "`ray_kill`, or `exit` (a hard process exit inside the learner). The "
                           "syncer is always killed with `ray_kill`.",
    "chaos.events[].repair_s": "No restart before this many seconds after the fault.",
    "chaos.events[].duration_s": "How long it lasts, seconds.",
    "chaos.events[].factor": "Step-time multiplier.",
    "chaos.events[].extra_latency_ms": "Added one-way latency (`network` only).",
    "chaos.events[].bandwidth_gbps": "Bandwidth cap, Gbit/s (`network` only); null: no cap.",
    "chaos.events[].loss_rate": "Probability that a relayed segment is lost, played as TCP's "
                                "retransmission delay (`network` only; a remote region's relay "
                                "plays it, the in-cluster emulation does not).",
    # run
    "run.duration_s": "How long `islands run` trains, seconds (`--duration` overrides it).",
    "run.run_dir": "The run directory; `{name}` becomes the job name (`--run-dir` overrides it).",
    "run.progress_every_s": "Seconds between progress lines on the console.",
    "run.dashboard": "Start the Ray dashboard with an embedded cluster (bound to 127.0.0.1).",
    # link (docs/regions.md)
    "regions.<name>.remote": "The region runs in its own Ray cluster and joins over the link "
                             "(`islands region join`); its agent launches and restarts its "
                             "learners. Needs `link.port`.",
    "link": "The gRPC link that regions in their own Ray clusters join (docs/regions.md).",
    "link.port": "Port of the link server; null: no link (default); 0 picks a free port "
                 "(printed at start).",
    "link.host": "Address the link server binds; anything but loopback needs `link.tls`.",
    "link.token_file": "File holding the bearer token every link call must carry; null: the "
                       "`ISLANDS_LINK_TOKEN` environment variable.",
    "link.tls": "TLS for the link server; null: plaintext (loopback only).",
    "link.tls.cert_file": "The server's certificate (PEM).",
    "link.tls.key_file": "Its private key (PEM).",
    "link.tls.client_ca_file": "CA of the region agents' certificates; set: mutual TLS.",
    "link.chunk_bytes": "Data bytes per gRPC message; larger pushes, replies and registrations "
                        "are streamed in chunks of this size.",
    "link.max_message_bytes": "Largest push, reply or registration accepted (after chunking); "
                              "larger ones are refused with RESOURCE_EXHAUSTED.",
    "link.keepalive_s": "HTTP/2 keepalive ping interval and timeout of the server, seconds.",
    "link.agent_home_timeout_s": "A region agent that has not reached home for this long stops "
                                 "its learners and exits, so its cluster can be released (one "
                                 "told by the home that the job ended leaves at once). Set at "
                                 "home: agents take it from the job's config.",
    "link.premerge": "Regional pre-merge: each remote region sends one push per fragment round, "
                     "the token-weighted mean of its learners' drifts, and fans the home's reply "
                     "out to them (WAN bytes per merged token fall about L-fold for L learners "
                     "in the region). Needs `syncer.merge_rule: mean`; see docs/regions.md.",
    "link.premerge_window_s": "With `link.premerge`: the longest a region's round waits for its "
                              "other learners after its first push, seconds; null: "
                              "`quorum.grace_cap_s`.",
}

# Rules that validators (or the job's start) enforce beyond a single field's bounds.
RULES: dict[str, str] = {
    "model.d_model": "divisible by `model.n_heads`",
    "data.corpus": "gives at least one train and one eval file (checked by `islands run` before "
                   "it starts Ray)",
    "data.batch_size": "a batch of batch_size × (`model.seq_len` + 1) tokens fits in the train "
                       "split and in memory (checked by `islands run` before it starts Ray)",
    "learner.inner_optimizer.total_steps": "> `warmup_steps` (checked when the learners are "
                                           "built)",
    "syncer.fragments": "≤ the model's parameter tensors (checked by `islands run` before it "
                        "starts Ray)",
    "task.path": "imports, its factory builds a Task and its loss is a scalar (traced with "
                 "abstract shapes by `islands run` before it starts Ray)",
    "syncer.overlap_steps": "< `syncer.sync_every_steps`",
    "quorum.min_learners": "≤ the learners of all regions together",
    "regions": f"at least one; names match `{REGION_NAME.pattern}`",
    "regions.<name>.max_learners": "≥ `learners`",
    "regions.<name>.speed_factors": "each > 0; a list has one entry per learner",
    "regions.<name>.devices_per_host": "whole for `cpu`, for `tpu` (1, 2, 4 or 8, at most a "
                                       "host's chips) and above 1 GPU; the region's nodes hold "
                                       "them (checked by `islands run`)",
    "regions.<name>.hosts_per_learner": "for `tpu`, the topology's hosts; above 1 needs "
                                        "`learner.sharding: replicated` and no spares",
    "regions.<name>.tpu_type": "required with `accelerator: tpu`, refused otherwise",
    "regions.<name>.topology": "required with `accelerator: tpu`, refused otherwise; AxB for "
                               "v5e and v6e, AxBxC for v4 and v5p, whole hosts",
    "health.timeout_s": "> `health.heartbeat_s`",
    "link.port": "set when any region is `remote`",
    "link.tls": "required when `link.host` is not loopback and `link.port` is set",
    "link.premerge": "only with `syncer.merge_rule: mean`",
    "chaos.events[].target@kill": "a configured learner, or `syncer`",
    "chaos.events[].target@region_loss": "a configured region",
    "chaos.events[].target@slowdown": "a configured learner or region",
    "chaos.events[].target@network": "a configured region (`partition`: or `@home` with remote regions)",
}

INTRO = """\
A job is one YAML file, read once and validated before any actor starts. Every key has a default
unless it is marked **required**; an unknown key, or a key written twice, is an error, and an
error names the field path, the rule and the values
(`quorum.min_learners: quorum (5) exceeds learners (4)`).

- `islands config check FILE` validates a file and prints it with every default filled in.
- `islands config schema` prints the JSON schema (for editors and CI).

The symbols (P, H, τ, K, γ, α) are those of [the architecture](architecture.md#vocabulary).
A small job:

```yaml
name: demo
syncer: {fragments: 4, sync_every_steps: 8, overlap_steps: 2}
quorum: {min_learners: 1}
regions:
  us-east: {learners: 2, latency_ms: 20, bandwidth_gbps: 1.0}
  eu-west: {learners: 2, latency_ms: 40, bandwidth_gbps: 1.0}
run: {duration_s: 110}
```
"""


class Row(NamedTuple):
    path: str
    type: str
    default: str
    constraints: str
    description: str


class Section(NamedTuple):
    path: str              # "" for the top level
    title: str
    intro: str
    rows: list[Row]
    variants: list         # [(tag, is_default, rows)] for a tagged union; else []


# -- helpers ---------------------------------------------------------------------------------------
def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _heading(path: str) -> str:
    return f"`{path}`" if path else "Top level"


def _link(path: str) -> str:
    return f"[`{path}`](#{_slug(_heading(path))})"


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _strip_annotated(tp: Any) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _union_args(tp: Any) -> Optional[tuple]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return None


def _split_optional(tp: Any) -> tuple[Any, bool]:
    args = _union_args(tp)
    if args and type(None) in args:
        rest = tuple(a for a in args if a is not type(None))
        return (rest[0] if len(rest) == 1 else typing.Union[rest]), True
    return tp, False


def _model_union(tp: Any) -> Optional[tuple]:
    """The member models of a tagged union of sections, else None."""
    args = _union_args(_strip_annotated(tp))
    if args and all(_is_model(a) for a in args):
        return args
    return None


def _tags(model: type) -> tuple[str, ...]:
    return typing.get_args(model.model_fields["type"].annotation)


def _type_name(tp: Any, path: str) -> str:
    tp = _strip_annotated(tp)
    tp, optional = _split_optional(tp)
    tp = _strip_annotated(tp)
    suffix = " or null" if optional else ""
    if _model_union(tp):
        return f"section by `type`, see {_link(path)}{suffix}"
    if _is_model(tp):
        return f"section, see {_link(path)}{suffix}"
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        values = [f"`{v}`" for v in typing.get_args(tp)]
        return ("one of " if len(values) > 1 else "") + ", ".join(values) + suffix
    if origin is dict:
        _, value = typing.get_args(tp)
        inner = _type_name(value, f"{path}.<name>")
        return f"mapping of name to {inner}{suffix}"
    if origin is list:
        (item,) = typing.get_args(tp)
        if _model_union(item) or _is_model(_strip_annotated(item)):
            return f"list, see {_link(path + '[]')}{suffix}"
        return f"list of {_type_name(item, path)}{suffix}"
    args = _union_args(tp)
    if args:
        return " or ".join(_type_name(a, path) for a in args) + suffix
    names = {bool: "boolean", int: "integer", float: "number", str: "string", Any: "any value"}
    if tp in names:
        return names[tp] + suffix
    raise TypeError(f"{path}: no documentation name for type {tp!r}")


def _flow(value: Any) -> str:
    """A value as YAML flow text."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", exclude_defaults=True)
    elif isinstance(value, dict):
        value = {k: (v.model_dump(mode="json", exclude_defaults=True)
                     if isinstance(v, BaseModel) else v) for k, v in value.items()}
    text = yaml.safe_dump(value, default_flow_style=True, width=10 ** 6, allow_unicode=True)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def _default(field, tp: Any) -> str:
    if field.is_required():
        return "**required**"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel) and _model_union(tp):
        dumped = value.model_dump(mode="json", exclude_defaults=True)
        dumped = {"type": value.type, **{k: v for k, v in dumped.items() if k != "type"}}
        return f"`{_flow(dumped)}`"
    if isinstance(value, BaseModel):
        return "(its defaults)"
    return f"`{_flow(value)}`"


def _number(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _constraints(field, path: str, tag: Optional[str]) -> str:
    parts = []
    for item in field.metadata:
        if isinstance(item, annotated_types.Ge):
            parts.append(f"≥ {_number(item.ge)}")
        elif isinstance(item, annotated_types.Gt):
            parts.append(f"> {_number(item.gt)}")
        elif isinstance(item, annotated_types.Le):
            parts.append(f"≤ {_number(item.le)}")
        elif isinstance(item, annotated_types.Lt):
            parts.append(f"< {_number(item.lt)}")
        elif isinstance(item, annotated_types.MinLen):
            parts.append("not empty" if item.min_length == 1 else f"length ≥ {item.min_length}")
        elif isinstance(item, annotated_types.MaxLen):
            parts.append(f"length ≤ {item.max_length}")
        elif isinstance(item, annotated_types.MultipleOf):
            parts.append(f"a multiple of {_number(item.multiple_of)}")
        elif getattr(item, "pattern", None):
            parts.append(f"matches `{item.pattern}`")
    rule = RULES.get(f"{path}@{tag}") if tag else None
    rule = rule or RULES.get(path)
    if rule:
        parts.append(rule)
    return "; ".join(parts)


def _note(path: str, tag: Optional[str]) -> Optional[str]:
    if tag is not None and f"{path}@{tag}" in FIELD_NOTES:
        return FIELD_NOTES[f"{path}@{tag}"]
    return FIELD_NOTES.get(path)


def _description(field, path: str, tag: Optional[str]) -> str:
    own = (field.description or "").strip()
    note = _note(path, tag)
    if own and note and len(own.split()) == 1:  # a symbol ("P"): the note says what it is
        return f"{own}: {note}"
    return own or note or ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# -- the walk --------------------------------------------------------------------------------------
def _rows(model: type, prefix: str, tag: Optional[str] = None) -> Iterator[tuple[Row, Any, str]]:
    names = list(model.model_fields)
    if tag is not None:  # a variant: its tag first, then the fields in schema order
        names.sort(key=lambda name: name != "type")
    for name in names:
        field = model.model_fields[name]
        path = f"{prefix}.{name}" if prefix else name
        tp = field.annotation
        yield (Row(path, _type_name(tp, path), _default(field, tp),
                   _constraints(field, path, tag), _description(field, path, tag)), tp, path)


def _variant_tag(model: type) -> str:
    return _tags(model)[0]


def sections() -> list[Section]:
    """Every section of JobConfig, depth first, in the schema's field order."""
    out: list[Section] = []

    def visit(model: Optional[type], path: str, union: Optional[tuple] = None,
              default_tag: Optional[str] = None) -> None:
        intro = (_note(path, None) or "") if path else ""
        nested: list[tuple[Any, str]] = []
        if union is None:
            rows = []
            for row, tp, child in _rows(model, path):
                rows.append(row)
                nested.append((tp, child))
            out.append(Section(path, _heading(path), intro, rows, []))
        else:
            variants = []
            for member in union:
                tag = _variant_tag(member)
                rows = []
                for row, tp, child in _rows(member, path, tag):
                    rows.append(row)
                    if child.rsplit(".", 1)[-1] != "type":
                        nested.append((tp, child))
                variants.append((" | ".join(_tags(member)), tag == default_tag, rows))
            out.append(Section(path, _heading(path), intro, [], variants))
        for tp, child in nested:
            inner, _ = _split_optional(_strip_annotated(tp))
            inner = _strip_annotated(inner)
            members = _model_union(inner)
            if members:
                default = None
                parent = _owner(model, union, child)
                if parent is not None:
                    value = parent.model_fields[child.rsplit(".", 1)[-1]].get_default()
                    default = getattr(value, "type", None)
                visit(None, child, members, default)
            elif _is_model(inner):
                visit(inner, child)
            elif typing.get_origin(inner) is dict and _is_model(typing.get_args(inner)[1]):
                visit(typing.get_args(inner)[1], f"{child}.<name>")
            elif typing.get_origin(inner) is list:
                item = typing.get_args(inner)[0]
                members = _model_union(item)
                if members:
                    visit(None, f"{child}[]", members, None)
                elif _is_model(_strip_annotated(item)):
                    visit(_strip_annotated(item), f"{child}[]")

    visit(JobConfig, "")
    return out


def _owner(model: Optional[type], union: Optional[tuple], child: str) -> Optional[type]:
    name = child.rsplit(".", 1)[-1]
    for candidate in ([model] if model is not None else list(union or ())):
        if candidate is not None and name in candidate.model_fields:
            return candidate
    return None


def _table(rows: list[Row]) -> list[str]:
    lines = ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append("| " + " | ".join(_cell(c) for c in (
            f"`{r.path}`", r.type, r.default, r.constraints, r.description)) + " |")
    return lines


def missing_descriptions() -> list[str]:
    """Dotted paths (with ``@tag`` for a variant) of fields that render without a description."""
    missing = []
    for section in sections():
        groups = [(None, section.rows)] + [(tag, rows) for tag, _, rows in section.variants]
        for tag, rows in groups:
            missing += [r.path + (f"@{tag}" if tag else "") for r in rows if not r.description]
    return missing


def fields_without_own_description() -> list[str]:
    """Fields whose text comes only from ``FIELD_NOTES`` (their ``description=`` is missing or
    a bare symbol): the ones config.py should describe itself."""
    paths = []

    def walk(model: type, prefix: str) -> None:
        for name, field in model.model_fields.items():
            path = f"{prefix}.{name}" if prefix else name
            own = (field.description or "").strip()
            if len(own.split()) <= 1 and path not in paths:
                paths.append(path)
            inner, _ = _split_optional(_strip_annotated(field.annotation))
            inner = _strip_annotated(inner)
            if _is_model(inner):
                walk(inner, path)
            for member in _model_union(inner) or ():
                walk(member, path)
            if typing.get_origin(inner) is dict and _is_model(typing.get_args(inner)[1]):
                walk(typing.get_args(inner)[1], f"{path}.<name>")
            if typing.get_origin(inner) is list:
                for member in _model_union(typing.get_args(inner)[0]) or ():
                    walk(member, f"{path}[]")

    walk(JobConfig, "")
    return paths


def render_markdown() -> str:
    """docs/config.md: the intro, a table of contents and one table per section."""
    all_sections = sections()
    lines = ["# Configuration reference", "",
             f"<!-- Generated from the JobConfig schema by `{GENERATE_COMMAND}`; "
             "do not edit by hand. -->", "", INTRO.rstrip("\n"), "", "## Sections", ""]
    for s in all_sections:
        lines.append(f"- [{s.title}](#{_slug(s.title)})")
    for s in all_sections:
        lines += ["", f"## {s.title}", ""]
        if s.intro:
            lines += [s.intro, ""]
        if s.variants:
            tags = ", ".join(f"`{t}`" for t, _, _ in s.variants)
            default = next((t for t, d, _ in s.variants if d), None)
            choose = f"Choose one by `type`: {tags}"
            lines += [choose + (f" (default `{default}`)." if default else "."), ""]
            for tag, is_default, rows in s.variants:
                lines += [f"### `type: {tag}`" + (" (default)" if is_default else ""), ""]
                lines += _table(rows) + [""]
            lines.pop()
        else:
            lines += _table(s.rows)
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    """Prints docs/config.md to stdout (UTF-8)."""
    del argv
    text = render_markdown()
    buffer = getattr(sys.stdout, "buffer", None)
    if buffer is not None:
        sys.stdout.flush()
        buffer.write(text.encode("utf-8"))
        buffer.flush()
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
