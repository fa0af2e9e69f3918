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

// Writes every parameter as F32 with its PyTorch name and shape (atomically: temporary file, then rename).
template <class Net>
void save_weights(const Net& net, const std::filesystem::path& path, const std::map<std::string, std::string>& meta = {}) {
  const auto& layout = net.layout();
  std::vector<float> host(static_cast<std::size_t>(layout.total));
  copy_n(net.params().data(), host.size(), host.data());
  std::vector<tensor_ref> refs;
  for (const auto& s : layout.slots)
    refs.push_back(make_tensor_ref<float>(s.name, std::span<const float>(host.data() + s.offset, s.shape.numel()),
                                          s.shape.vec()));
  save_safetensors(path, refs, meta);
}

// Reads every parameter of the network from the file; a missing name, a wrong dtype or a wrong shape is an
// error naming it, and the network is left untouched unless every tensor loads.
template <class Net>
void load_weights(Net& net, const std::filesystem::path& path) {
  const auto file = safetensors_file::open(path);
  const auto& layout = net.layout();
  std::vector<float> host(static_cast<std::size_t>(layout.total), 0.f);
  for (const auto& s : layout.slots) {
    const auto dims = s.shape.vec();
    file.read<float>(s.name, std::span<float>(host.data() + s.offset, s.shape.numel()), dims);
  }
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
  copy_n(host.data(), host.size(), net.params().data());
}

}  // namespace dml::train
