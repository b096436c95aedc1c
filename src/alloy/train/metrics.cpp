#include "alloy/train/metrics.h"

#include <cstdio>
#include <sstream>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/core/tensorboard.h"

namespace alloy::train {

Metrics::Metrics(const std::string& run_dir, bool tensorboard, int64_t resume_step, const std::string& tb_dir) {
  path_ = run_dir + "/metrics.jsonl";
  if (resume_step >= 0 && file_exists(path_)) {
    std::istringstream in(read_file(path_));
    std::string line, kept;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      try {
        auto j = nlohmann::json::parse(line);
        if (j.value("step", int64_t{0}) <= resume_step) kept += line + "\n";
      } catch (const nlohmann::json::exception&) {
        // A line cut short by a crash: drop it.
      }
    }
    write_file_atomic(path_, kept);
  } else if (resume_step < 0) {
    write_file_atomic(path_, "");
  }
  f_.reset(std::fopen(path_.c_str(), "a"));
  if (!f_) throw InputError(path_, "cannot open for appending");
  if (tensorboard) {
    const std::string dir = tb_dir.empty() ? run_dir + "/tensorboard" : tb_dir;
    ensure_writable_dir(dir);
    tb_ = std::make_unique<TensorBoardWriter>(dir);
  }
}

Metrics::~Metrics() = default;

void Metrics::log(const nlohmann::json& rec) {
  std::string line = rec.dump() + "\n";
  std::fwrite(line.data(), 1, line.size(), f_.get());
  std::fflush(f_.get());
  if (tb_) {
    int64_t step = rec.value("step", int64_t{0});
    for (auto it = rec.begin(); it != rec.end(); ++it) {
      if (!it.value().is_number() || it.key() == "step") continue;
      std::string tag = it.key().rfind("val_", 0) == 0 ? "val/" + it.key().substr(4) : "train/" + it.key();
      tb_->scalar(tag, it.value().get<float>(), step);
    }
    tb_->flush();
  }
}

}  // namespace alloy::train
