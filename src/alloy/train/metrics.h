#pragma once
// Per-step metrics: OUTPUT/metrics.jsonl (one JSON object per line) and, if enabled, TensorBoard
// scalars under OUTPUT/tensorboard/.
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

namespace alloy {
class TensorBoardWriter;
}

namespace alloy::train {

class Metrics {
 public:
  // RESUME_STEP >= 0 keeps only the lines of steps <= RESUME_STEP from an earlier run, so a
  // resumed run's file reads as one uninterrupted run.
  // TB_DIR: where the TensorBoard event files go (empty: RUN_DIR/tensorboard).
  Metrics(const std::string& run_dir, bool tensorboard, int64_t resume_step, const std::string& tb_dir = "");
  ~Metrics();
  // Appends REC (must hold "step"); numeric fields also go to TensorBoard as "train/<key>" or,
  // for keys starting with "val_", "val/<rest>".
  void log(const nlohmann::json& rec);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f_{nullptr, &std::fclose};
  std::unique_ptr<TensorBoardWriter> tb_;
};

}  // namespace alloy::train
