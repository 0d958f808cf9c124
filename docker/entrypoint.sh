#!/bin/sh
# Container entrypoint: `python -m app serve "$@"`, with a replica id nginx can route by.
#
# Without SLOTSERVE_REPLICA_ID, the replica id is the container's hostname: Docker makes it the
# container's 12-hex short id, which Docker's DNS resolves to this container inside its networks.
# Server-made request ids are then "<hostname>-<32 hex>", and docker/nginx.conf sends
# DELETE /generate/<hostname>-... to <hostname>:8000, the replica that holds the request.
# A hostname that is not [A-Za-z0-9]{1,16} (app/config.py) is not used (server-made ids get no
# prefix and are routed like client ids); SLOTSERVE_REPLICA_ID= (empty) also turns it off.
set -eu

if [ -z "${SLOTSERVE_REPLICA_ID+set}" ]; then
    case "${HOSTNAME:-}" in
        "" | *[!A-Za-z0-9]*)
            echo "slotserve-entrypoint: hostname '${HOSTNAME:-}' is not [A-Za-z0-9]{1,16};" \
                "server-made request ids get no replica prefix" >&2
            ;;
        *)
            if [ "${#HOSTNAME}" -le 16 ]; then
                export SLOTSERVE_REPLICA_ID="$HOSTNAME"
            else
                echo "slotserve-entrypoint: hostname '$HOSTNAME' is longer than 16 characters;" \
                    "server-made request ids get no replica prefix" >&2
            fi
            ;;
    esac
elif [ -z "$SLOTSERVE_REPLICA_ID" ]; then
    unset SLOTSERVE_REPLICA_ID
fi

exec python -m app serve "$@"
