#include <cstdio>

#include "alloy/cli/commands.h"
#include "alloy/core/log.h"
#include "alloy/data/prepare.h"

namespace alloy::cli {

void add_data_commands(CLI::App& app, Action& action) {
  auto* data = app.add_subcommand("data", "Dataset tools");
  data->require_subcommand(1);
  auto o = std::make_shared<data::PrepareOptions>();
  auto* prep = data->add_subcommand("prepare", "Tokenize text files into Megatron .bin/.idx datasets PREFIX_train and PREFIX_valid");
  prep->add_option("-i,--input", o->inputs, "Text files, or directories of text files")->required()->check(CLI::ExistingPath);
  prep->add_option("-t,--tokenizer", o->tokenizer, "byte | gpt2 | sentencepiece")
      ->capture_default_str()
      ->check(CLI::IsMember({"byte", "gpt2", "sentencepiece"}));
  prep->add_option("--vocab-dir", o->vocab_dir, "Directory with encoder.json and vocab.bpe (gpt2)");
  prep->add_option("--tokenizer-model", o->tokenizer_model,
                   "SentencePiece model file (sentencepiece; LLaMA's tokenizer.model). Train with the same "
                   "data.tokenizer=sentencepiece and data.tokenizer_model for eval and generate");
  prep->add_flag("--add-bos", o->add_bos,
                 "sentencepiece: start each document with the model's <s>, as Megatron's Llama2Tokenizer does (then train with "
                 "data.add_bos=true)");
  prep->add_option("-o,--output", o->output, "Output prefix")->required();
  prep->add_option("--valid-fraction", o->valid_fraction, "Share of documents held out for validation")->capture_default_str();
  prep->add_option("--doc-sep", o->doc_sep, "Document separator: auto | fortune | blank | line | file")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "fortune", "blank", "line", "file"}));
  prep->callback([o, &action]() {
    action = [o]() {
      auto r = data::prepare_dataset(*o);
      std::printf("%s: %llu documents, %llu tokens\n%s: %llu documents, %llu tokens\nvocabulary: %d (%s)\n",
                  r.train_prefix.c_str(), (unsigned long long)r.train_docs, (unsigned long long)r.train_tokens,
                  r.valid_prefix.c_str(), (unsigned long long)r.valid_docs, (unsigned long long)r.valid_tokens,
                  r.vocab_size, o->tokenizer.c_str());
      return 0;
    };
  });
}

}  // namespace alloy::cli
