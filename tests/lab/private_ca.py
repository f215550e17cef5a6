# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A private CA and a server certificate it signed, for an index (or a proxy) that nothing trusts by default.

Test code, on the controller: it uses the ``cryptography`` package (requirements/dev.lock). The CA lives a day;
the server certificate names ``localhost`` and ``127.0.0.1``, where tests/lab/standins/index_server.py listens.

    ca = make_ca(directory)  # {"ca": ca.pem, "cert": server.pem, "key": server.key} (paths)

From the command line (molecule's training_venv scenario, for an index served over HTTPS inside a lab CT):

    private_ca.py DIRECTORY  # writes the three files, prints their paths as JSON
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(common_name):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_usage(**on):
    usages = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment", "key_agreement")
    usages += ("key_cert_sign", "crl_sign", "encipher_only", "decipher_only")
    return x509.KeyUsage(**{usage: usage in on for usage in usages})


def make_ca(directory, hosts=("localhost",), addresses=("127.0.0.1",)):
    """Write ``ca.pem`` (a self-signed CA), ``server.pem`` and ``server.key`` (a certificate for ``hosts`` and
    ``addresses`` the CA signed) into ``directory``; return their paths as ``{"ca", "cert", "key"}``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    valid = {"not_valid_before": now - datetime.timedelta(hours=1), "not_valid_after": now + datetime.timedelta(days=1)}
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder(**valid)
        .subject_name(_name("pve-gpu-recover test CA"))
        .issuer_name(_name("pve-gpu-recover test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(_key_usage(key_cert_sign=True, crl_sign=True, digital_signature=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName(host) for host in hosts] + [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
    cert = (
        x509.CertificateBuilder(**valid)
        .subject_name(_name(hosts[0]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(digital_signature=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": directory / "ca.pem", "cert": directory / "server.pem", "key": directory / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    paths["key"].chmod(0o600)
    return paths


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit("usage: private_ca.py DIRECTORY")
    print(json.dumps({name: str(path) for name, path in make_ca(argv[0]).items()}))


if __name__ == "__main__":
    main()
