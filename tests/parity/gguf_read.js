// Reads a GGUF file with Hugging Face's JS parser (@huggingface/gguf, from the npm test data) and
// prints its metadata and tensor infos as JSON, for Export.GgufIsWhatLlamaCppAndHfGgufRead to
// compare with what loom wrote. Arrays are printed whole; 64-bit integers as numbers.
//   NODE_PATH=<node_modules holding @huggingface/gguf and @huggingface/tasks> node gguf_read.js FILE
const { gguf } = require("@huggingface/gguf");
(async () => {
  const { metadata, tensorInfos } = await gguf(process.argv[2], { allowLocalFile: true });
  const plain = (v) => (typeof v === "bigint" ? Number(v) : Array.isArray(v) ? v.map(plain) : v);
  const out = { metadata: {}, tensors: [] };
  for (const [key, value] of Object.entries(metadata)) out.metadata[key] = plain(value);
  for (const t of tensorInfos) out.tensors.push({ name: t.name, shape: t.shape.map(Number), dtype: t.dtype, offset: Number(t.offset) });
  console.log(JSON.stringify(out));
})().catch((e) => {
  console.error(String(e));
  process.exit(1);
});
