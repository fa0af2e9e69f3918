// SPDX-License-Identifier: Apache-2.0
// dml/train/options.hpp — what a trainer is told (trainer_options) and what a step returns (step_result).
// Sits on parallel/routing.hpp; train/trainer.hpp reads them.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dml/parallel/routing.hpp"

namespace dml::train {

// Every member here has a default initialiser, so `{.seed = 1}` names only what it changes and
// -Wmissing-field-initializers stays quiet for a user who builds with -Wextra.
struct trainer_options {
  std::uint64_t seed = 0;           // initial weights and dropout masks
  double bucket_mb = 25.0;          // gradient bucket size in MiB (whole layers; at least one layer each)
  std::int64_t micro_batches = 1;   // the local batch is split into this many; gradients accumulate
  // The rows of each micro-batch of a rank's batch, in order (as many as micro_batches, each at least 1, summing to
  // the rows step() is given); empty: the batch splits evenly. A pipeline whose stages are unequal fills its
  // bubble sooner with a smaller first micro-batch (dml::cost::rank_pipelines prices such splits).
  std::vector<std::int64_t> micro_batch_rows{};
  float clip_norm = 0.f;            // global-norm clipping; 0 turns it off
  std::function<float(std::int64_t step)> lr{};  // learning rate per step (from 1); empty: the optimizer's lr
  bool record_events = false;       // keep an event log of compute and communication (tests, tracing)
  // A file for the run's timeline (Chrome trace-event JSON, for Perfetto UI and chrome://tracing): rank 0 checks at
  // construction that it can write it, every rank records, and trainer::write_trace() gathers and writes it. Empty:
  // no trace, and each record costs one branch.
  std::string trace{};
  // The most bytes of dml buffers this rank's trainer may hold at once (memory().allocated: model state, activation
  // storage, workspaces; 0: no limit). An allocation past it throws dml::memory_limit_error naming the limit, the
  // allocation and what is held, before it is made; dml::cost::rank_bytes(...).total() is the least that trains.
  std::int64_t memory_limit = 0;
  float initial_loss_scale = 65536.f;  // fp16: where dynamic loss scaling starts (PyTorch's default)
  // Pipeline: the group's ranks form pipeline_stages stages of size()/pipeline_stages data-parallel
  // ranks (Megatron's order, data-parallel rank fastest), cut at stage_cuts or balanced by predicted time (each
  // layer's training FLOPs at cost_rows input rows: parallel::stage_chunks).
  int pipeline_stages = 1;
  std::vector<std::size_t> stage_cuts{};  // first layer of each (virtual) stage after the first
  std::int64_t cost_rows = 64;
  std::string schedule{};  // by name ("gpipe", "1f1b", "interleaved:2", "zb") or a CSV file; empty: the policy's
  bool recompute = false;  // keep only each stage's inputs; recompute its forward inside backward
  // Tensor parallelism (Megatron): groups of tensor_parallel consecutive ranks split every layer that has a
  // tensor-parallel form (nn::gpt's); sequence_parallel also splits the regions between them by tokens. The
  // world is tensor_parallel × data-parallel × pipeline_stages ranks.
  int tensor_parallel = 1;
  bool sequence_parallel = false;
  // Expert parallelism: groups of expert_parallel consecutive data-parallel ranks share out the experts of
  // every mixture-of-experts layer (nn::moe, gpt's MoE blocks); an expert's gradients sum over the ranks that
  // hold it, the other parameters' over the whole data-parallel group.
  int expert_parallel = 1;
  // Context parallelism: groups of context_parallel consecutive data-parallel ranks hold the same sequences,
  // each a chunk of their tokens (zig-zag: chunks r and 2·cp−1−r of 2·cp, which balances causal attention),
  // and attention runs as ring attention over the group (cp_all_gather: K/V all-gathered over it at once, their
  // gradients reduce-scattered back, as the Llama 3 report trains). Ranks of a group pass the same rows to step().
  int context_parallel = 1;
  bool cp_zigzag = true;
  bool cp_all_gather = false;
  // ZeRO-2/3 on a pipeline: false reduces a chunk's gradients once per step, so the chunk holds its whole
  // gradients (and under ZeRO-3 its parameters) from its unshard to its reshard; true reduces after every
  // backward and ZeRO-3 gathers parameters bucket by bucket around each pass, as on one stage: less memory,
  // more traffic. Schedules that split backward (zb) always reduce per step.
  bool micro_batch_residency = false;
  // Hybrid sharding (parallel::hybrid<zero<S>>): the data-parallel ranks form `replicas` replicas of
  // consecutive ranks; ZeRO shards within each and the replicas' shards sum their gradients once per step.
  // Above 1 only with a hybrid sharding.
  int replicas = 1;
  // Gradient compression (DDP and ZeRO, fp32 on the host): "none", "onebit", "onebit:B" or "topk:F" with
  // 0 < F <= 1; error feedback keeps what a step did not send (parallel/compressed.hpp).
  std::string compress = "none";
  // ZeRO-Offload's disk tier: "optimizer:disk:DIR" keeps each rank's optimizer state slots in files in DIR
  // (an existing, writable directory) instead of memory, read and written offload_bucket_mb at a time around
  // the update (parallel/offload.hpp); "optimizer,master:disk:DIR" keeps the float master weights of mixed
  // precision there too (a slot after the state's). Empty: in memory.
  std::string offload{};
  double offload_bucket_mb = 1.0;
  // Steps as transactions (ft/elastic.hpp): called once per step after the gradients are reduced and before
  // the update; false abandons the step (no update, the step count stays, step_result::committed is false).
  // Empty: every step commits, at no cost. With element-wise optimizers nothing after the vote waits for a peer:
  // ZeRO-1/2 gather the updated parts before the next pass instead of after the update. Layer-wise optimizers
  // (LAMB, LARS) under ZeRO sum their norms over the shards after the commit, so a failure there leaves the
  // update half done: drive those with whole-step votes (ft::train_restarting), not with this hook.
  std::function<bool()> commit{};
};

// How save_checkpoint writes: now (it returns with the checkpoint durable and named by latest), or in the
// background (it copies this rank's pieces and returns; threads write the files while training goes on, and
// latest moves once every rank's file is complete and synced).
enum class save_mode { sync, async };

using parallel::routing_summary;

struct step_result {
  float loss = 0.f;        // mean over the global batch, the same on every rank (every stage too)
  double grad_norm = 0.0;  // global gradient norm before clipping (computed when clipping is on)
  bool skipped = false;    // fp16: the gradients overflowed, the update was skipped and the scale shrank
  float loss_scale = 1.f;  // fp16: the loss scale after this step
  routing_summary routing{};  // mixture of experts: tokens per expert, drops, auxiliary losses
  // Bytes this rank sent for the step's gradient reductions, and what dense reductions would send.
  std::int64_t gradient_bytes = 0, dense_gradient_bytes = 0;
  bool committed = true;  // false: trainer_options::commit abandoned the step
};

// What one rank holds of a trainer's state (parameters, optimizer state, counters), to hand to a peer that
// holds the same part (ft/elastic.hpp heals a member from it) or to restore after an abandoned configuration.
struct state_snapshot {
  std::int64_t step = 0, optimizer_step = 0;
  std::uint64_t seed = 0;
  float loss_scale = 1.f;
  std::int64_t growth_tracker = 0;  // fp16's loss scaler
  std::vector<float> values;  // for k = -1 (parameters), 0, 1, ... (optimizer slots): what the sharding holds
};

}  // namespace dml::train
