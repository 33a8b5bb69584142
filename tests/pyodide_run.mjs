// Run a Python script under Pyodide (in node), on a copy of some of the repository's files.
// node tests/pyodide_run.mjs PYODIDE_DIR REPO_ROOT SCRIPT FILE...  -> the script's stdout on ours;
// the load and run times on stderr.
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";

const [pyodideDir, root, script, ...files] = process.argv.slice(2);
const { loadPyodide } = await import(pathToFileURL(`${pyodideDir}/pyodide.mjs`).href);
const started = Date.now();
const py = await loadPyodide({ indexURL: `${pyodideDir}/` });
const loaded = Date.now();
py.setStdout({ batched: (line) => console.log(line) });
for (const file of files) {
  py.FS.mkdirTree(`/home/pyodide/${file.split("/").slice(0, -1).join("/")}`);
  py.FS.writeFile(`/home/pyodide/${file}`, readFileSync(`${root}/${file}`, "utf8"));
}
py.runPython(readFileSync(script, "utf8"));
console.error(`pyodide ${py.version}: loaded in ${loaded - started} ms, ran in ${Date.now() - loaded} ms`);
