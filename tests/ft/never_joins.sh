#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# tests/ft/never_joins.sh PROGRAM — under dml-run: rank 0 trains with --elastic and waits for the others to join the
# coordinator; every other rank never joins (it sleeps), so dml-run's stall deadline must end the job.
if [ "$DML_RANK" = 0 ]; then
  exec "$1" --elastic --steps 5 --hidden 8
fi
exec sleep 60
