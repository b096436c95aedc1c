#pragma once
// File helpers. Every write that matters goes through AtomicFile so a crash or a full disk never
// leaves a half-written file where a good one was.
#include <cstdint>
#include <string>
#include <string_view>

namespace alloy {

// Writes to PATH.tmp.<pid>, then fsync + rename over PATH on commit(). Destroying an uncommitted
// AtomicFile removes the temporary file and leaves PATH untouched.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t n);
  void write(std::string_view s) { write(s.data(), s.size()); }
  uint64_t bytes_written() const { return written_; }
  void commit();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::string tmp_;
  int fd_ = -1;
  uint64_t written_ = 0;
  bool committed_ = false;
};

void write_file_atomic(const std::string& path, std::string_view contents);
std::string read_file(const std::string& path);  // throws InputError naming the path
bool file_exists(const std::string& path);
// The running program's own file (/proc/self/exe), or "" when it cannot be read: how `alloy`
// finds itself to start ranks and sweep cells, and its helpers beside it.
std::string executable_path();
// Creates DIR (and parents) and checks that it is writable; throws InputError naming it otherwise.
void ensure_writable_dir(const std::string& dir);
// fsync a directory so a rename inside it is durable.
void fsync_dir(const std::string& dir);
// Removes PATH and everything under it; a missing PATH is no error. Returns false if something
// could not be removed. Not std::filesystem::remove_all: PyTorch's pip LibTorch 2.x exports its
// own copy of it, which programs linked against that LibTorch call instead of libstdc++'s, and it
// crashed (a call through a null pointer) on a path that did not exist.
bool remove_tree(const std::string& path);

}  // namespace alloy
