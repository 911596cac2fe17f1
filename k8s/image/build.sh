#!/usr/bin/env bash
# Build the image from the checked-out commit, push it, and pin it for every manifest by its
# digest (k8s/image/kustomization.yaml), so a node added mid-run pulls the very code the run
# started with. The tag is the commit, never a name reused across builds (`0.1.0`, `latest`):
# with `imagePullPolicy: IfNotPresent` a node that already holds a reused tag keeps its old
# build. Needs docker (logged in to the registry), git and a standalone kustomize.
#   k8s/image/build.sh <registry>/archipelago
set -euo pipefail
repo=${1:?usage: k8s/image/build.sh <registry>/archipelago}
cd "$(git rev-parse --show-toplevel)"
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "uncommitted changes: commit them first (the image is tagged with the commit it was built from)" >&2
  exit 2
fi
commit=$(git rev-parse HEAD)
docker build -f k8s/Dockerfile --build-arg "ARCHIPELAGO_COMMIT=${commit:0:12}" -t "$repo:$commit" .
docker push "$repo:$commit"
pinned=$(docker inspect --format '{{index .RepoDigests 0}}' "$repo:$commit")  # <repo>@sha256:<digest>
(cd k8s/image && kustomize edit set image "archipelago=$pinned")
echo "every manifest now runs $pinned (built from $commit)"
