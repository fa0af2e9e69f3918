// SPDX-License-Identifier: Apache-2.0
// dml/plan/cluster.hpp — a cluster description as JSON (what dml-plan --cluster reads and --calibrate writes); byte
// sizes as people write them ("80GiB") are train/flags.hpp's parse_bytes.
// Sits on plan/cost.hpp and nlohmann-json; used by tools/dml-plan. See DESIGN.md §7.
#pragma once

#include <cmath>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "dml/core/error.hpp"
#include "dml/plan/cost.hpp"
#include "dml/train/flags.hpp"

namespace dml::cost {

using dml::parse_bytes;  // train/flags.hpp: "80GiB" as bytes

inline nlohmann::json to_json(const cluster& c) {
  nlohmann::json j = {{"devices_per_node", c.devices_per_node}, {"memory_bytes", c.memory_bytes},
                      {"flops_fp32", c.flops_fp32},             {"flops_bf16", c.flops_bf16},
                      {"intra_bandwidth", c.intra_bandwidth},   {"intra_latency", c.intra_latency},
                      {"inter_bandwidth", c.inter_bandwidth},   {"inter_latency", c.inter_latency},
                      {"memory_bandwidth", c.memory_bandwidth}, {"elementwise_bandwidth", c.elementwise_bandwidth},
                      {"elementwise_bandwidth_bf16", c.elementwise_bandwidth_bf16},
                      {"block_seconds", c.block_seconds},       {"block_seconds_bf16", c.block_seconds_bf16}};
  if (c.intra_gather_bandwidth > 0) j["intra_gather_bandwidth"] = c.intra_gather_bandwidth;  // 0: intra_bandwidth's
  if (!c.gemm_rows.empty()) j["gemm_rows"] = c.gemm_rows;  // [[rows, share], ...]
  return j;
}

// Fields left out keep cluster{}'s defaults (elementwise_bandwidth_bf16 left out follows elementwise_bandwidth, and
// block_seconds_bf16 block_seconds); an unknown field, or one that is not a positive number (block_seconds and
// block_seconds_bf16: not negative), is refused by name.
inline cluster cluster_from_json(const nlohmann::json& j, std::string_view where = "cluster") {
  if (!j.is_object()) fail<format_error>(where, ": expected a JSON object, found ", j.type_name());
  cluster c;
  if (!j.contains("elementwise_bandwidth_bf16") && j.contains("elementwise_bandwidth") && j["elementwise_bandwidth"].is_number())
    c.elementwise_bandwidth_bf16 = j["elementwise_bandwidth"].get<double>();
  if (!j.contains("block_seconds_bf16") && j.contains("block_seconds") && j["block_seconds"].is_number())
    c.block_seconds_bf16 = j["block_seconds"].get<double>();
  for (const auto& item : j.items()) {
    const std::string& key = item.key();  // not a structured binding: clang before 16 cannot capture one
    const nlohmann::json& value = item.value();
    if (key == "gemm_rows") {  // [[rows, share], ...], rows increasing
      auto bad = [&] {
        fail<format_error>(where, ": field 'gemm_rows' must be a list of [rows, share] pairs of positive numbers "
                           "in increasing rows, found ", value.dump());
      };
      if (!value.is_array()) bad();
      for (const auto& p : value) {
        if (!p.is_array() || p.size() != 2 || !p[0].is_number() || !p[1].is_number() || !(p[0].get<double>() > 0) ||
            !(p[1].get<double>() > 0) || (!c.gemm_rows.empty() && !(p[0].get<double>() > c.gemm_rows.back().first)))
          bad();
        c.gemm_rows.emplace_back(p[0].get<double>(), p[1].get<double>());
      }
      continue;
    }
    double* target = key == "memory_bytes" ? &c.memory_bytes : key == "flops_fp32" ? &c.flops_fp32
                   : key == "flops_bf16" ? &c.flops_bf16 : key == "intra_bandwidth" ? &c.intra_bandwidth
                   : key == "intra_latency" ? &c.intra_latency : key == "inter_bandwidth" ? &c.inter_bandwidth
                   : key == "inter_latency" ? &c.inter_latency
                   : key == "intra_gather_bandwidth" ? &c.intra_gather_bandwidth
                   : key == "memory_bandwidth" ? &c.memory_bandwidth
                   : key == "elementwise_bandwidth" ? &c.elementwise_bandwidth
                   : key == "elementwise_bandwidth_bf16" ? &c.elementwise_bandwidth_bf16
                   : key == "block_seconds" ? &c.block_seconds : key == "block_seconds_bf16" ? &c.block_seconds_bf16 : nullptr;
    if (key.starts_with("block_seconds")) {
      if (!value.is_number() || !(value.get<double>() >= 0) || !std::isfinite(value.get<double>()))
        fail<format_error>(where, ": field '", key, "' must be a number of seconds of at least 0, found ", value.dump());
    } else if (!value.is_number() || !(value.get<double>() > 0))
      fail<format_error>(where, ": field '", key, "' must be a positive number, found ", value.dump());
    if (key == "devices_per_node") {
      if (!value.is_number_integer()) fail<format_error>(where, ": field 'devices_per_node' must be an integer, found ", value.dump());
      c.devices_per_node = value.get<int>();
    } else if (target) *target = value.get<double>();
    else
      fail<format_error>(where, ": unknown field '", key, "'; expected devices_per_node, memory_bytes, flops_fp32, flops_bf16, ",
                         "intra_bandwidth, intra_latency, inter_bandwidth, inter_latency, intra_gather_bandwidth, memory_bandwidth, ",
                         "elementwise_bandwidth, elementwise_bandwidth_bf16, block_seconds, block_seconds_bf16 or gemm_rows");
  }
  return c;
}

}  // namespace dml::cost
