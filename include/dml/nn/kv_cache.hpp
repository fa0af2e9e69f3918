// SPDX-License-Identifier: Apache-2.0
// dml/nn/kv_cache.hpp — incremental decoding: every attention layer's keys and values of the tokens seen so far, so
// that each new token costs one token's forward (its q, k and v, attention over the cached keys) instead of the
// whole window's, as llama2.c's run.c decodes. nn::gpt_block and nn::llama_block read it from context::kv and
// nn::gpt_embedding offsets its positions by it; nn::forward_cached runs a network over the next tokens. Host only,
// one rank's whole model (no tensor or context parallelism). Sits on nn/tile_attention.hpp (a prompt's first pass
// runs the tile attention; each later token attends here) and nn/layer.hpp. See DESIGN.md §4.
//
//     nn::kv_cache cache(cfg.seq);                      // keys and values of up to seq positions
//     auto logits = nn::forward_cached(net, cache, prompt_ids);   // [1, P, V]: the prompt, one pass
//     ...                                                           // pick the next id from the last row
//     logits = nn::forward_cached(net, cache, next_id);              // [1, 1, V]: one token's forward
//     auto ids = nn::generate(net, cache, prompt, 100, pick);         // or let it loop: pick(logits row, i) → id
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "dml/core/algorithm.hpp"
#include "dml/core/error.hpp"
#include "dml/core/space.hpp"
#include "dml/core/tensor.hpp"
#include "dml/nn/layer.hpp"
#include "dml/nn/tile_attention.hpp"

namespace dml::nn {

class kv_cache {
 public:
  // capacity: the positions it holds (a model's seq: RoPE's table and GPT's position embedding end there).
  explicit kv_cache(std::int64_t capacity) : capacity_(capacity) {
    if (capacity < 1) fail<invalid_argument>("dml::nn::kv_cache: expected a capacity of at least 1 position, found ", capacity);
  }
  std::int64_t capacity() const { return capacity_; }
  // Positions cached: the next token's position.
  std::int64_t length() const { return length_; }
  // Forget every position (the storage stays, for the next prompt).
  void clear() { length_ = 0; }
  // Bytes of keys and values held for capacity positions.
  std::int64_t bytes() const {
    std::int64_t n = 0;
    for (const auto& e : layers_) n += static_cast<std::int64_t>((e.k.size() + e.v.size()) * sizeof(float));
    return n;
  }

  // That n new tokens fit after the cached ones; `what` names the caller in the error.
  void check_room(const char* what, std::int64_t n) const {
    if (n < 1 || length_ + n > capacity_)
      fail<invalid_argument>(what, ": ", length_, " positions are cached of ", capacity_, "; expected 1 to ",
                             capacity_ - length_, " new tokens, found ", n, " (clear() it, or start again from a "
                             "shorter window)");
  }

  // The positions of the n new tokens of each of `batch` sequences, token-major as [batch, n]: length() + t.
  const std::int64_t* positions(std::int64_t batch, std::int64_t n) {
    check_room("dml::nn::kv_cache", n);
    positions_.resize(static_cast<std::size_t>(batch * n));
    for (std::int64_t i = 0; i < batch * n; ++i) positions_[static_cast<std::size_t>(i)] = length_ + i % n;
    return positions_.data();
  }

  // Attention of layer `layer` for s.seq new tokens of each of s.batch sequences at positions length() onward: their
  // k and v (qkv rows as nn::tile_attention_forward reads them, RoPE already applied) join the cache, and y gets each
  // query's attention over every cached key up to its own position. The first pass (length() 0) is the tile attention
  // itself (lse as it writes it); later ones run here, one query row at a time (lse untouched).
  template <execution_space S, class T>
  void attend(std::size_t layer, const tile_attention_shape& s, const T* qkv, T* y, float* lse) {
    constexpr const char* what = "dml::nn::kv_cache::attend";
    if constexpr (!std::same_as<S, host>) {
      fail<invalid_argument>(what, ": the cache is on the host; decode a model built in the host space");
    } else {
      check_room(what, s.seq);
      entry& e = entry_of(what, layer, s);
      used_ = true;
      const std::int64_t kv = s.kv(), hd = s.head_dim, row = s.row();
      for (std::int64_t b = 0; b < s.batch; ++b)
        for (std::int64_t t = 0; t < s.seq; ++t) {
          const T* r = qkv + (b * s.seq + t) * row + s.heads * hd;
          for (std::int64_t g = 0; g < kv; ++g) {
            const std::size_t at = static_cast<std::size_t>(((b * kv + g) * capacity_ + length_ + t) * hd);
            for (std::int64_t i = 0; i < hd; ++i) {
              e.k[at + static_cast<std::size_t>(i)] = static_cast<float>(r[g * hd + i]);
              e.v[at + static_cast<std::size_t>(i)] = static_cast<float>(r[(kv + g) * hd + i]);
            }
          }
        }
      if (length_ == 0) {
        tile_attention_forward<host>(s, qkv, y, lse);
        return;
      }
      const float scale = 1.f / std::sqrt(static_cast<float>(hd));
      const std::int64_t first = length_, cap = capacity_;
      const float *K = e.k.data(), *V = e.v.data();
      // One (sequence, new token, head) a call: an online softmax over keys 0 .. its position.
      for_each_row<host>(s.batch * s.seq * s.heads, [=](std::int64_t i) {
        const std::int64_t h = i % s.heads, t = i / s.heads % s.seq, b = i / s.heads / s.seq;
        const T* q = qkv + (b * s.seq + t) * row + h * hd;
        const std::int64_t g = h / s.group(), keys = first + t + 1;
        const float* kb = K + (b * kv + g) * cap * hd;
        const float* vb = V + (b * kv + g) * cap * hd;
        std::vector<float> acc(static_cast<std::size_t>(hd), 0.f), qs(static_cast<std::size_t>(hd));
        for (std::int64_t d = 0; d < hd; ++d) qs[static_cast<std::size_t>(d)] = static_cast<float>(q[d]) * scale;
        float m = -HUGE_VALF, l = 0.f;
        for (std::int64_t j = 0; j < keys; ++j) {
          const float* kj = kb + j * hd;
          float dot = 0.f;
          for (std::int64_t d = 0; d < hd; ++d) dot += qs[static_cast<std::size_t>(d)] * kj[d];
          if (dot > m) {
            const float c = std::exp(m - dot);
            l *= c;
            for (auto& a : acc) a *= c;
            m = dot;
          }
          const float p = std::exp(dot - m);
          l += p;
          const float* vj = vb + j * hd;
          for (std::int64_t d = 0; d < hd; ++d) acc[static_cast<std::size_t>(d)] += p * vj[d];
        }
        T* out = y + (b * s.seq + t) * s.width() + h * hd;
        for (std::int64_t d = 0; d < hd; ++d) out[d] = static_cast<T>(acc[static_cast<std::size_t>(d)] / l);
      }, (first + s.seq) * hd * 2);
    }
  }

  // Called by the embedding of a model with learned positions: the first new token's position, checked to leave
  // room for n tokens.
  std::int64_t first_position(std::int64_t n) const {
    check_room("dml::nn::kv_cache", n);
    return length_;
  }

  // nn::forward_cached's bookkeeping: n positions were filled by one forward, and some layer did fill them.
  void advance(std::int64_t n) {
    check_room("dml::nn::kv_cache", n);
    length_ += n;
  }
  bool take_used() { return std::exchange(used_, false); }

 private:
  struct entry {
    std::int64_t batch = 0, kv = 0, head_dim = 0;
    std::vector<float> k, v;  // [batch, kv, capacity, head_dim] each
  };
  entry& entry_of(const char* what, std::size_t layer, const tile_attention_shape& s) {
    if (layers_.size() <= layer) layers_.resize(layer + 1);
    entry& e = layers_[layer];
    if (e.k.empty() || length_ == 0) {
      e = {s.batch, s.kv(), s.head_dim, {}, {}};
      const auto n = static_cast<std::size_t>(s.batch * s.kv() * capacity_ * s.head_dim);
      e.k.assign(n, 0.f);
      e.v.assign(n, 0.f);
    } else if (e.batch != s.batch || e.kv != s.kv() || e.head_dim != s.head_dim) {
      fail<invalid_argument>(what, ": layer ", layer, " cached ", e.batch, " sequences of ", e.kv, " key/value heads of ",
                             e.head_dim, ", found ", s.batch, " of ", s.kv(), " of ", s.head_dim,
                             " (clear() the cache before another batch)");
    }
    return e;
  }

  std::int64_t capacity_, length_ = 0;
  std::vector<entry> layers_;
  std::vector<std::int64_t> positions_;
  bool used_ = false;
};

// The network's forward over the next tokens ids [batch, n] (the same sequences each call; clear() the cache for new
// ones), its attention layers reading and extending `cache`: logits [batch, n, V] as a forward over all
// cache.length() + n tokens would give for the last n. A network without a layer that keeps a cache fails.
template <class Network>
auto forward_cached(Network& net, kv_cache& cache, tensor_view<const float, host> ids) {
  if (ids.shape.rank != 2)
    fail<shape_error>("dml::nn::forward_cached: expected token ids [batch, n], found shape ", ids.shape);
  cache.check_room("dml::nn::forward_cached", ids.shape[1]);
  context c;
  c.training = false;
  c.kv = &cache;
  auto y = net.forward(ids, c);
  if (!cache.take_used())
    fail<invalid_argument>("dml::nn::forward_cached: no layer of the network keeps a KV cache (nn::gpt's and "
                           "nn::llama's blocks do)");
  cache.advance(ids.shape[1]);
  return y;
}

// n tokens after `prompt` (token ids of one sequence, at least one), each chosen by next(logits of the last position,
// V floats; i) from the model's output over the tokens before it, as forward_cached gives it: the prompt (its last
// capacity tokens) in one call, then one token a call. When the window is full the cache starts again from its last
// capacity / 2 tokens (one call over them), so a token costs one token's forward plus a share of those refills.
template <class Network, class Next>
std::vector<float> generate(Network& net, kv_cache& cache, std::span<const float> prompt, std::int64_t n, Next next) {
  if (prompt.empty()) fail<invalid_argument>("dml::nn::generate: expected a prompt of at least one token, found none");
  std::vector<float> tokens(prompt.begin(), prompt.end()), out;
  const auto window = [&](std::int64_t keep) {
    cache.clear();
    const float* first = tokens.data() + tokens.size() - static_cast<std::size_t>(keep);
    return forward_cached(net, cache, tensor_view<const float>(first, {1, keep}));
  };
  auto logits = window(std::min<std::int64_t>(cache.capacity(), static_cast<std::int64_t>(tokens.size())));
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t vocab = logits.shape[2];
    const auto id = static_cast<float>(next(logits.data + (logits.shape[1] - 1) * vocab, i));
    tokens.push_back(id);
    out.push_back(id);
    if (i + 1 == n) break;
    if (cache.length() == cache.capacity()) logits = window(std::max<std::int64_t>(1, cache.capacity() / 2));
    else logits = forward_cached(net, cache, tensor_view<const float>(&tokens.back(), {1, 1}));
  }
  return out;
}

}  // namespace dml::nn
