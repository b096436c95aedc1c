// Precompiled once per build; every LibTorch translation unit reuses it (see CMakeLists.txt).
#pragma once
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/autograd.h>
#include <torch/types.h>
#include <nlohmann/json.hpp>
#include <map>
#include <memory>
#include <string>
#include <vector>
