// Reference side of tests/tokenizer_vs_js.sh: encodes files with the gpt-3-encoder npm package
// (a port of OpenAI's GPT-2 encoder) and prints ids in tokenize_tool's format.
//   node gpt2_encode.js PACKAGE_DIR DELIM FILE...
// Documents are split exactly as tokenize_tool --split-line DELIM splits them.
'use strict';
const fs = require('fs');
const path = require('path');

const [pkgDir, delim, ...files] = process.argv.slice(2);
if (!pkgDir || delim === undefined || files.length === 0) {
  console.error('usage: node gpt2_encode.js PACKAGE_DIR DELIM FILE...');
  process.exit(2);
}
const { encode } = require(path.resolve(pkgDir, 'Encoder.js'));

function splitDocuments(text) {
  const docs = [];
  let cur = '';
  let start = 0;
  while (start < text.length) {
    const nl = text.indexOf('\n', start);
    const lineEnd = nl < 0 ? text.length : nl;
    const next = nl < 0 ? text.length : nl + 1;
    if (text.slice(start, lineEnd) === delim) {
      docs.push(cur);
      cur = '';
    } else {
      cur += text.slice(start, next);
    }
    start = next;
  }
  if (cur.length) docs.push(cur);
  return docs;
}

const out = [];
for (const f of files) {
  for (const doc of splitDocuments(fs.readFileSync(f, 'utf8'))) out.push(encode(doc).join(' '));
}
fs.writeSync(1, out.join('\n') + (out.length ? '\n' : ''));
