"""`layerline certs`: a cluster's CA and its members' certificates (made by `shared/certs.py`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from layerline.shared.certs import ALWAYS_HOSTS, CA_DAYS, LEAF_DAYS, subject_names, write_cluster_certs
from layerline.shared.tls import ROLES

from .support import HelpFormatter, Subcommands, reported_as_errors

# HelpFormatter keeps indented lines as written and fills each other line as one paragraph.
ROLES_HELP = (
    "roles (a certificate's subject common name is its holder's role):\n"
    "  coordinator  the coordinator: serves the cluster port and calls the stages\n"
    "  stage        every stage worker: serves steps and calls the next stage and the coordinator\n"
    "  client       a caller that is no member (an operator's tool); the coordinator's client API\n"
    "               asks for no certificate: its clients need only ca.crt, to trust the coordinator\n"
    "Each process is given ca.crt and its role's certificate and key (--tls-ca, --tls-cert, "
    "--tls-key). ca.key only issues more certificates: keep it off the cluster's machines.\n"
    "\n"
    "bring your own CA:\n"
    "For each role, issue a certificate signed by your CA whose subject common name is the role "
    "(CN=coordinator, CN=stage, CN=client), with extended key usage serverAuth and clientAuth and "
    "every name it is reached at as a subject alternative name (a DNS name or an IP address; "
    "127.0.0.1 for calls on one machine). Give --tls-ca your CA's certificate, --tls-cert the "
    "certificate (intermediate CA certificates appended after it), --tls-key its unencrypted PEM "
    "key. Members trust any certificate your CA signs for a role: use a CA for this cluster only."
)


def _run_certs(args: argparse.Namespace) -> int:
    hosts = args.hosts.split(",") if args.hosts else []
    with reported_as_errors(ValueError, OSError):
        names = subject_names(hosts)
        files = write_cluster_certs(args.directory, hosts, force=args.force, leaf_days=args.days, ca_days=args.ca_days)
    print(f"wrote a new cluster CA and certificates to {files.directory}", flush=True)
    print(f"  valid for {', '.join(names)}: {args.days} days (the CA {args.ca_days})")
    print(f"  {files.ca}  the CA's certificate: every process and client trusts it (--tls-ca)")
    print(f"  {files.ca_key}  the CA's key: only issues more certificates; keep it off the cluster")
    for role in ROLES:
        print(f"  {files.cert(role)}  {files.key(role)}  CN={role} (--tls-cert, --tls-key)")
    return 0


def add_certs_commands(commands: Subcommands) -> None:
    """`layerline certs DIR --hosts NAME,...`: a CA and a certificate per role."""
    certs = commands.add_parser(
        "certs",
        help="make a cluster's CA and a TLS certificate for each role",
        description="Make a new CA in DIR (ca.crt, ca.key) and, for each role, a certificate it "
        "signs and that certificate's key (coordinator.crt and .key, stage.crt and .key, "
        "client.crt and .key): ECDSA P-256, serverAuth and clientAuth, valid for the "
        f"--hosts and always for {' and '.join(ALWAYS_HOSTS)}. Keys are written mode 0600, "
        "a new DIR mode 0700. Existing files are never replaced without --force.",
        epilog=ROLES_HELP,
        formatter_class=HelpFormatter,
    )
    certs.add_argument("directory", type=Path, metavar="DIR", help="where to write the files")
    certs.add_argument(
        "--hosts",
        default="",
        metavar="NAME,...",
        help="comma-separated DNS names and IP addresses the members are reached at "
        f"(default: none; {', '.join(ALWAYS_HOSTS)} are always included)",
    )
    certs.add_argument(
        "--days",
        type=int,
        default=LEAF_DAYS,
        metavar="N",
        help=f"validity of each role's certificate (default: {LEAF_DAYS})",
    )
    certs.add_argument(
        "--ca-days", type=int, default=CA_DAYS, metavar="N", help=f"validity of the CA (default: {CA_DAYS})"
    )
    certs.add_argument("--force", action="store_true", help="replace files already in DIR (with a new CA)")
    certs.set_defaults(handler=_run_certs)
