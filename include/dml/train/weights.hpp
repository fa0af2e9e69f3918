// SPDX-License-Identifier: Apache-2.0
// dml/train/weights.hpp — a network's parameters to and from safetensors, named as PyTorch names them.
// Sits on nn/network.hpp and train/safetensors.hpp.
#pragma once

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "dml/nn/network.hpp"
#include "dml/train/safetensors.hpp"

namespace dml::train {

// Writes every parameter of a flat buffer laid out by `layout` as F32 with its PyTorch name and shape
// (atomically: temporary file, then rename). `flat` is host memory.
inline void save_weights(const nn::param_layout& layout, std::span<const float> flat, const std::filesystem::path& path,
                         const std::map<std::string, std::string>& meta = {}) {
  std::vector<tensor_ref> refs;
  for (const auto& s : layout.slots)
    refs.push_back(make_tensor_ref<float>(s.name, flat.subspan(static_cast<std::size_t>(s.offset), s.shape.numel()),
                                          s.shape.vec()));
  save_safetensors(path, refs, meta);
}

// Reads every parameter of `layout` from the file into `flat` (host memory). A missing or unknown name,
// a wrong dtype or a wrong shape is an error naming it, and `flat` is left untouched unless all load.
inline void load_weights(const nn::param_layout& layout, std::span<float> flat, const std::filesystem::path& path) {
  const auto file = safetensors_file::open(path);
  std::vector<float> staged(flat.size(), 0.f);
  for (const auto& s : layout.slots)
    file.read<float>(s.name, std::span<float>(staged.data() + s.offset, s.shape.numel()), s.shape.vec());
  if (file.tensors().size() != layout.slots.size()) {
    std::string extra;
    for (const auto& t : file.tensors()) {
      bool known = false;
      for (const auto& s : layout.slots) known = known || s.name == t.name;
      if (!known) extra += (extra.empty() ? "" : ", ") + t.name;
    }
    fail<format_error>(path.string(), ": expected the ", layout.slots.size(), " tensors of the model, found ",
                       file.tensors().size(), " (unknown: ", extra, ")");
  }
  std::copy(staged.begin(), staged.end(), flat.begin());
}

// The same for a network, in whichever space its parameters live.
template <class Net>
void save_weights(const Net& net, const std::filesystem::path& path, const std::map<std::string, std::string>& meta = {}) {
  std::vector<float> host(static_cast<std::size_t>(net.layout().total));
  copy_n(net.params().data(), host.size(), host.data());
  save_weights(net.layout(), host, path, meta);
}
template <class Net>
void load_weights(Net& net, const std::filesystem::path& path) {
  std::vector<float> host(static_cast<std::size_t>(net.layout().total));
  load_weights(net.layout(), host, path);
  copy_n(host.data(), host.size(), net.params().data());
}

}  // namespace dml::train
