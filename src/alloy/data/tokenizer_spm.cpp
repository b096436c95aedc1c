// SentencePiece through the alloy-spm helper process (tools/alloy_spm.cpp has the protocol): Debian's
// SentencePiece crashes a process that also loads LibTorch, so it never enters ours.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>

#include "alloy/core/error.h"
#include "alloy/core/fs.h"
#include "alloy/data/tokenizer.h"

extern char** environ;

namespace alloy::data {

std::string spm_helper_path() {
  if (const char* e = std::getenv("ALLOY_SPM"); e && *e) return e;
  const std::string self = executable_path();
  if (self.empty()) return "";
  const auto p = std::filesystem::path(self).parent_path() / "alloy-spm";
  return std::filesystem::exists(p) ? p.string() : "";
}

namespace {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(const std::string& model, bool add_bos) : model_(model), add_bos_(add_bos) {
    if (model.empty())
      throw InputError("data.tokenizer_model", "the sentencepiece tokenizer needs its model file (Megatron's --tokenizer-model)");
    if (!std::filesystem::is_regular_file(model)) throw InputError(model, "no such SentencePiece model file");
    const std::string helper = spm_helper_path();
    if (helper.empty() || ::access(helper.c_str(), X_OK) != 0)
      throw InputError("data.tokenizer", "sentencepiece runs in the alloy-spm helper, which is not beside this alloy" +
                                             (helper.empty() ? std::string() : " (" + helper + ")") +
                                             ": it is built when libsentencepiece-dev is installed (scripts/install-deps.sh), or set ALLOY_SPM");
    int sv[2], err[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) throw Error(std::string("cannot start alloy-spm: ") + std::strerror(errno));
    if (::pipe2(err, O_CLOEXEC) != 0) {
      const int e = errno;
      ::close(sv[0]), ::close(sv[1]);
      throw Error(std::string("cannot start alloy-spm: ") + std::strerror(e));
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, sv[1], 0);
    posix_spawn_file_actions_adddup2(&fa, sv[1], 1);
    posix_spawn_file_actions_adddup2(&fa, err[1], 2);
    std::string h = helper, m = model;
    char* argv[] = {h.data(), m.data(), nullptr};
    const int rc = ::posix_spawn(&pid_, helper.c_str(), &fa, nullptr, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    ::close(sv[1]);
    ::close(err[1]);
    fd_ = sv[0];
    err_ = err[0];
    if (rc != 0) {
      pid_ = -1;
      stop();
      throw Error("cannot start " + helper + ": " + std::strerror(rc));
    }
    // The constructor's failures stop the helper here: the destructor does not run for them.
    try {
      char magic[4];
      int32_t head[5];
      pollfd pfd{fd_, POLLIN, 0};
      if (::poll(&pfd, 1, 60000) <= 0) throw InputError(model, "the SentencePiece helper " + helper + " did not answer within 60 s");
      if (!recv_all(magic, 4) || std::memcmp(magic, "ASPM", 4) != 0 || !recv_all(head, sizeof head) || head[0] != 1)
        throw InputError(model, "cannot be loaded by SentencePiece (helper " + helper + "): " + helper_error());
      vocab_ = head[1], eos_ = head[2], bos_ = head[3];
      if (vocab_ <= 0) throw InputError(model, "has no pieces");
      if (eos_ < 0) throw InputError(model, "has no end-of-sentence piece (trained with --eos_id=-1): documents could not be told apart");
      if (add_bos_ && bos_ < 0) throw InputError(model, "has no beginning-of-sentence piece, which data.add_bos asks for");
    } catch (...) {
      stop();
      throw;
    }
  }
  ~SentencePieceTokenizer() override { stop(); }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::lock_guard<std::mutex> lock(mu_);
    request('E', text.size());
    send_all(text.data(), text.size());
    const uint64_t k = answer();
    const size_t first = add_bos_ ? 1 : 0;  // Megatron's Llama2Tokenizer starts every text with <s>
    std::vector<int32_t> ids(first + k);
    if (add_bos_) ids[0] = bos_;
    if (!recv_all(ids.data() + first, k * sizeof(int32_t))) throw Error(model_ + ": alloy-spm stopped: " + helper_error());
    return ids;
  }

  // SentencePiece drops control pieces when it decodes, so each end-of-text id is written out here.
  std::string decode(const std::vector<int32_t>& ids) const override {
    for (int32_t id : ids)
      if (id < 0 || id >= vocab_) throw Error("token id " + std::to_string(id) + " is outside the vocabulary [0, " + std::to_string(vocab_) + ")");
    std::string out;
    std::vector<int32_t> run;
    auto flush = [&]() {
      if (run.empty()) return;
      std::lock_guard<std::mutex> lock(mu_);
      request('D', run.size());
      send_all(run.data(), run.size() * sizeof(int32_t));
      const uint64_t n = answer();
      std::string s(n, '\0');
      if (!recv_all(s.data(), n)) throw Error(model_ + ": alloy-spm stopped: " + helper_error());
      out += s;
      run.clear();
    };
    for (int32_t id : ids) {
      if (id == eos_) {
        flush();
        out += "<|endoftext|>";
      } else {
        run.push_back(id);
      }
    }
    flush();
    return out;
  }
  int32_t vocab_size() const override { return vocab_; }
  int32_t eot_id() const override { return eos_; }
  std::string name() const override { return "sentencepiece"; }

 private:
  bool recv_all(void* p, size_t n) const {
    char* c = static_cast<char*>(p);
    while (n > 0) {
      const ssize_t r = ::recv(fd_, c, n, 0);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return false;
      c += r, n -= static_cast<size_t>(r);
    }
    return true;
  }
  void send_all(const void* p, size_t n) const {
    const char* c = static_cast<const char*>(p);
    while (n > 0) {
      const ssize_t r = ::send(fd_, c, n, MSG_NOSIGNAL);  // a dead helper is an error, not SIGPIPE
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) throw Error(model_ + ": alloy-spm stopped: " + helper_error());
      c += r, n -= static_cast<size_t>(r);
    }
  }
  void request(char op, uint64_t n) const {
    send_all(&op, 1);
    send_all(&n, 8);
  }
  // The answer's length, or the helper's error message thrown.
  uint64_t answer() const {
    uint64_t n = 0;
    if (!recv_all(&n, 8)) throw Error(model_ + ": alloy-spm stopped: " + helper_error());
    if (n != ~uint64_t{0}) return n;
    uint64_t len = 0;
    std::string why;
    if (!recv_all(&len, 8) || len > (uint64_t{1} << 26) || (why.resize(len), !recv_all(why.data(), len)))
      throw Error(model_ + ": alloy-spm sent a broken error message");
    throw InputError(model_, "SentencePiece: " + why);
  }
  std::string helper_error() const {
    std::string s;
    char buf[512];
    ssize_t r;
    // A helper that is still running (a wrong ALLOY_SPM) must not hang us: wait a second at most.
    pollfd pfd{err_, POLLIN, 0};
    while (s.size() < 4000 && ::poll(&pfd, 1, 1000) > 0 && (r = ::read(err_, buf, sizeof buf)) > 0) s.append(buf, static_cast<size_t>(r));
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
    return s.empty() ? "no message" : s;
  }

  // Ends the helper: the end of its input stops it; one that does not read its input is killed.
  void stop() {
    if (fd_ >= 0) ::close(fd_), fd_ = -1;
    if (pid_ > 0) {
      int st = 0;
      for (int k = 0; k < 50 && ::waitpid(pid_, &st, WNOHANG) == 0; ++k) ::usleep(10000);
      if (::waitpid(pid_, &st, WNOHANG) == 0) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &st, 0);
      }
      pid_ = -1;
    }
    if (err_ >= 0) ::close(err_), err_ = -1;
  }

  std::string model_;
  bool add_bos_ = false;
  pid_t pid_ = -1;
  int fd_ = -1, err_ = -1;
  int32_t vocab_ = 0, eos_ = -1, bos_ = -1;
  mutable std::mutex mu_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_sentencepiece_tokenizer(const std::string& model, bool add_bos) {
  return std::make_unique<SentencePieceTokenizer>(model, add_bos);
}

}  // namespace alloy::data
