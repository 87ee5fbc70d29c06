"""Launch a recipe on a GKE TPU cluster with XPK (https://github.com/AI-Hypercomputer/xpk):

    python -m maxctx.launch configs/recipes/llama3.1-8b-14m-ring-tpu7x-128.yml --cluster my-cluster \\
        --tpu-type tpu7x-128 --num-slices 1 --image us-docker.pkg.dev/my-project/maxctx/tpu:latest [--dry-run] \\
        [-- run.steps=20 ...]

Builds the `xpk workload create` command that runs `python -m maxctx.train <recipe>` on every host of the slices,
prints it, and runs it unless --dry-run. The cluster, image and bucket names are checked against GKE's, the container
registries' and Cloud Storage's naming rules first; then the recipe against the TPU type (mesh sizes, slice count,
strategy constraints), so a config that cannot run fails here, not after the pods are scheduled; then its fit
(maxctx.compile.fit): a launch that changes the recipe's compiled step needs `--fit-report`. The image must hold the
repository at its working directory (docker/Dockerfile does), so the recipe is passed by its path under configs/.
xpk is run without a shell, with every value as one argument.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

from maxctx import config as config_lib
from maxctx import topology as topology_lib
from maxctx.compile import fit
from maxctx.compile import step as compile_step
from maxctx.errors import ConfigError, excerpt, exit_code

MAX_WORKLOAD_NAME = 40   # XPK's limit: the JobSet name also names pods and services


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  p = argparse.ArgumentParser(prog="python -m maxctx.launch", description=__doc__.split("\n\n")[0],
                              epilog="Arguments after `--` are section.key=value overrides for the recipe.")
  p.add_argument("recipe", help="a run config under configs/, e.g. configs/recipes/llama3.1-8b-14m-ring-tpu7x-128.yml")
  p.add_argument("--cluster", required=True, help="the GKE cluster XPK created")
  p.add_argument("--tpu-type", help="GKE/XPK TPU type, e.g. tpu7x-128 or v5p-128; default: the recipe's "
                 "compile.topology")
  p.add_argument("--num-slices", type=int, default=1, help="slices (multislice over DCN); the recipe's mesh.dcn sizes "
                 "must multiply to it, or --dcn-axis says which axis spans them")
  p.add_argument("--dcn-axis", choices=("data", "fsdp", "context"), help="set mesh.dcn.<axis>=--num-slices when the "
                 "recipe has no DCN axes of its own")
  p.add_argument("--image", required=True, help="the container image (docker/Dockerfile), pushed where GKE can pull")
  p.add_argument("--workload", help="workload name; default: the recipe name and a timestamp")
  p.add_argument("--output-dir", help="run.output_dir for the job, e.g. gs://bucket/runs (the workload name is "
                 "appended); default: the recipe's")
  p.add_argument("--project", help="Google Cloud project (default: gcloud's)")
  p.add_argument("--zone", help="zone of the cluster (default: gcloud's)")
  p.add_argument("--priority", choices=("very-low", "low", "medium", "high", "very-high"))
  p.add_argument("--max-restarts", type=int, default=0, help="restarts of the whole job after a failure (resume "
                 "from the last checkpoint)")
  p.add_argument("--xpk", default="xpk", help="the xpk executable")
  p.add_argument("--fit-report", metavar="JSON", help="`python -m maxctx.compile RECIPE ... --json` output proving "
                 "that the launched step fits, needed when it differs from the recipe's own compile section")
  p.add_argument("--dry-run", action="store_true", help="print the command and check the recipe; launch nothing")
  if "--" in argv:
    cut = argv.index("--")
    argv, overrides = argv[:cut], argv[cut + 1:]
  else:
    overrides = []
  return p.parse_args(argv), overrides


# Naming rules, so that a value the cloud would refuse (or a shell would misread) stops here, before anything starts.
# GKE: 1 to 40 characters, lower-case letters, digits and '-', starting with a letter, not ending with '-'.
CLUSTER = re.compile(r"[a-z](?:[a-z0-9-]{0,38}[a-z0-9])?")
# A container image reference (the distribution spec's grammar): [registry[:port]/]path[:tag][@digest].
_HOST = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])(?:\.(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9]))*"
_PATH = r"[a-z0-9]+(?:(?:[_.]|__|-+)[a-z0-9]+)*"
IMAGE = re.compile(rf"(?P<name>(?:{_HOST}(?::[0-9]+)?/)?{_PATH}(?:/{_PATH})*)(?::\w[\w.-]{{0,127}})?"
                   r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?", re.ASCII)
MAX_IMAGE_NAME = 255
# Cloud Storage: lower-case letters, digits, '-', '_' and '.', a letter or digit at each end; 3 to 63 characters, or
# up to 222 in dot-separated parts of at most 63.
BUCKET = re.compile(r"[a-z0-9](?:[a-z0-9._-]*[a-z0-9])?")


def check_names(cluster: str, image: str, output_dir: str | None) -> None:
  """Refuses a cluster, image or bucket name its service would not accept, naming the rule."""
  if not CLUSTER.fullmatch(cluster):
    raise ConfigError(f"--cluster {excerpt(cluster)} is not a GKE cluster name; use 1 to 40 lower-case letters, digits "
                      "and '-', starting with a letter and ending with a letter or digit.")
  reference = IMAGE.fullmatch(image)
  if not reference or len(reference["name"]) > MAX_IMAGE_NAME:
    raise ConfigError(f"--image {excerpt(image)} is not a container image reference; write it as "
                      "[registry[:port]/]path[:tag][@sha256:digest] with a lower-case path, e.g. "
                      "us-docker.pkg.dev/my-project/maxctx/tpu:latest.")
  if output_dir is not None:
    check_bucket(output_dir, "--output-dir")


def check_bucket(url: str, where: str) -> None:
  """Refuses a gs:// URL whose bucket Cloud Storage would not accept (local paths and other schemes pass)."""
  if not url.startswith("gs://"):
    return
  bucket = url.removeprefix("gs://").split("/", 1)[0]
  parts = bucket.split(".")
  if not BUCKET.fullmatch(bucket):
    why = "use lower-case letters, digits, '-', '_' and '.', starting and ending with a letter or digit"
  elif not 3 <= len(bucket) <= (222 if len(parts) > 1 else 63) or max(map(len, parts)) > 63:
    why = "a bucket name has 3 to 63 characters (up to 222 in dot-separated parts of at most 63)"
  elif re.fullmatch(r"[0-9]+(?:\.[0-9]+){3}", bucket):
    why = "a bucket name cannot be an IP address"
  elif bucket.startswith("goog") or re.search(r"g[o0][o0]gle", bucket):
    why = "a bucket name cannot start with 'goog' or contain 'google'"
  else:
    return
  raise ConfigError(f"{where} {excerpt(url)} names bucket {excerpt(bucket)}, which Cloud Storage does not allow: {why}.")


def workload_name(recipe: pathlib.Path, now: datetime.datetime | None = None) -> str:
  """`<recipe>-<MMDD-HHMM>` in the letters Kubernetes allows, short enough for XPK."""
  stamp = (now or datetime.datetime.now()).strftime("%m%d-%H%M")
  stem = re.sub(r"[^a-z0-9-]+", "-", recipe.stem.lower()).strip("-")
  return f"{stem[:MAX_WORKLOAD_NAME - len(stamp) - 1].rstrip('-')}-{stamp}"


def image_path(recipe: pathlib.Path) -> str:
  """The recipe's path in the image, whose working directory holds the repository: configs/<its path there>. The
  recipe lies under a `configs` directory: the installed package's, or a checkout's (a wheel's configs live in
  site-packages, while the recipe a user launches is the one in the checkout the image is built from)."""
  real = recipe.resolve()
  for configs in (config_lib.CONFIG_DIR.resolve(), *(p for p in real.parents if p.name == "configs")):
    if configs in real.parents:
      return str(pathlib.PurePosixPath("configs", *real.relative_to(configs).parts))
  raise ConfigError(f"recipe {recipe} is outside configs/ ({config_lib.CONFIG_DIR.resolve()}); the image holds only "
                    "the repository, so put the recipe under configs/ and rebuild the image.")


def build_command(args: argparse.Namespace, overrides: list[str]) -> tuple[list[str], str]:
  """(the xpk argv, the train command it runs on every host); raises ConfigError if the recipe cannot run there."""
  check_names(args.cluster, args.image, args.output_dir)
  recipe = pathlib.Path(args.recipe)
  if not recipe.is_file():
    raise ConfigError(f"recipe {args.recipe} does not exist; pass a file such as configs/recipes/"
                      "llama3.1-8b-14m-ring-tpu7x-128.yml.")
  if args.num_slices < 1:
    raise ConfigError(f"--num-slices is {args.num_slices}; a job has at least one slice.")
  workload = args.workload or workload_name(recipe)
  if not re.fullmatch(r"[a-z]([a-z0-9-]*[a-z0-9])?", workload) or len(workload) > MAX_WORKLOAD_NAME:
    raise ConfigError(f"--workload {excerpt(workload)} must be lower-case letters, digits and '-', start with a letter and "
                      f"have at most {MAX_WORKLOAD_NAME} characters.")
  train_overrides = list(overrides)
  if args.dcn_axis and args.num_slices > 1:
    train_overrides.append(f"mesh.dcn.{args.dcn_axis}={args.num_slices}")
  if args.output_dir:
    train_overrides.append(f"run.output_dir={args.output_dir.rstrip('/')}/{workload}")
  config = _load(recipe, train_overrides, args.tpu_type, args.num_slices)
  check_bucket(config.run.output_dir, f"run.output_dir of {recipe}")
  topo = topology_lib.resolve(args.tpu_type or config.compile.topology)
  fit.check_runs_on(config, topo, args.num_slices)
  shown = image_path(recipe)
  fit.check_fit_is_proven(recipe, shown, config, train_overrides, args.fit_report)

  train = ["python", "-m", "maxctx.train", shown, *train_overrides]
  command = shlex.join(train)
  xpk = [args.xpk, "workload", "create", "--cluster", args.cluster, "--workload", workload,
         "--tpu-type", topo.name, "--num-slices", str(args.num_slices), "--docker-image", args.image,
         "--max-restarts", str(args.max_restarts), "--command", command]
  for flag, value in (("--project", args.project), ("--zone", args.zone), ("--priority", args.priority)):
    if value:
      xpk += [flag, value]
  return xpk, command


def _load(recipe: pathlib.Path, overrides: list[str], tpu_type: str | None, num_slices: int):
  extra = [f"compile.topology={tpu_type}"] if tpu_type else []
  extra.append(f"compile.num_slices={num_slices}")
  try:
    return compile_step.load(str(recipe), overrides + extra)
  except ConfigError as e:
    if "no TPU topology" in str(e):
      raise ConfigError(f"no TPU type for {recipe}: pass --tpu-type (e.g. tpu7x-128) or add compile.topology to the "
                        "recipe.") from None
    raise


def main(argv: list[str] | None = None) -> int:
  args, overrides = parse_args(sys.argv[1:] if argv is None else argv)

  def body():
    xpk, _ = build_command(args, overrides)
    print(shlex.join(xpk))
    if args.dry_run:
      return 0
    if shutil.which(args.xpk) is None:
      raise ConfigError(f"{args.xpk} is not on PATH; install it (pip install xpk) or pass --xpk /path/to/xpk.")
    return subprocess.run(xpk, check=False).returncode

  return exit_code(body)


if __name__ == "__main__":
  sys.exit(main())
