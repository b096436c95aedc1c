#pragma once
// Moving weights between Alloy models, safetensors files and HuggingFace's config.json.
#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "alloy/core/config.h"
#include "alloy/model/safetensors.h"
#include "alloy/model/transformer.h"

namespace alloy::model {

TensorBlob to_blob(const at::Tensor& t);  // any device; copied to CPU, contiguous
at::Tensor from_blob(const TensorBlob& b, const std::string& where);
at::Tensor read_tensor(const SafetensorsFile& f, const std::string& name);
std::map<std::string, at::Tensor> read_all(const SafetensorsFile& f);

// Writes every parameter under its HuggingFace name (atomic). METADATA is added to the header.
void save_weights(const Transformer& m, const std::string& path, const std::map<std::string, std::string>& metadata = {});
// Copies weights by name into M. Every parameter of M must be in the file with the same shape;
// a mismatch names the file, the tensor and both shapes. Extra tensors are ignored only if
// ALLOW_EXTRA (a pipeline stage loads its slice from a full file).
void load_weights(Transformer& m, const SafetensorsFile& f, bool allow_extra = true);
// The same over a HuggingFace model split into shards: each parameter from the file that has it.
void load_weights(Transformer& m, const std::vector<const SafetensorsFile*>& files, bool allow_extra = true);
// The safetensors files PATH stands for: itself; a model.safetensors.index.json's shards (its
// weight_map, each file once, in the order the map first names them); or a HuggingFace model
// directory's model.safetensors.index.json or model.safetensors. Throws InputError naming the
// index and the tensor whose shard is missing, or the directory that holds neither.
std::vector<std::string> hf_weight_files(const std::string& path);

// HuggingFace config.json for the variant, and back.
nlohmann::json hf_config(const ModelConfig& m);
ModelConfig model_config_from_hf(const nlohmann::json& j, const std::string& where);

}  // namespace alloy::model
