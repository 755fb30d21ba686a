// A real OpenID provider for the identity tests (tests/identity, tests/portal/browser):
// `oidc-provider` from npm (a certified implementation), configured for one client,
// `heteroflow`, on the loopback address. Started by scripts/oidc-provider.sh.
//
// Environment: HF_OIDC_MODULE (oidc-provider's entry file), HF_OIDC_PORT, HF_OIDC_USERS (a
// JSON file {"login": {"email", "name", "groups": [...]}} read at every sign-in, so a test
// changes a person's groups by rewriting it), HF_OIDC_CLIENT_SECRET.
//
// Sign-in is oidc-provider's development interaction (any password; the login must be
// in HF_OIDC_USERS), then its consent page. PKCE is required of every client.
import { readFileSync } from 'node:fs';
import { pathToFileURL } from 'node:url';

const { default: Provider } = await import(pathToFileURL(process.env.HF_OIDC_MODULE).href);
const port = Number(process.env.HF_OIDC_PORT || 9400);
const issuer = `http://127.0.0.1:${port}`;

function users() {
  return JSON.parse(readFileSync(process.env.HF_OIDC_USERS, 'utf8'));
}

const configuration = {
  clients: [
    {
      client_id: 'heteroflow',
      client_secret: process.env.HF_OIDC_CLIENT_SECRET || 'heteroflow-test-secret',
      // native: a loopback redirect URI matches on any port (RFC 8252), so one provider
      // serves every control plane a test run starts on a free port
      application_type: 'native',
      redirect_uris: ['http://127.0.0.1/identity/oidc/test/callback'],
      post_logout_redirect_uris: ['http://127.0.0.1/portal/login/'],
      grant_types: ['authorization_code'],
      response_types: ['code'],
      token_endpoint_auth_method: 'client_secret_basic',
    },
  ],
  pkce: { required: () => true },
  claims: {
    openid: ['sub'],
    profile: ['preferred_username', 'name'],
    email: ['email'],
    groups: ['groups'],
  },
  // the claims go into the ID token too, as Keycloak's and Entra's group claims do
  conformIdTokenClaims: false,
  cookies: { keys: ['heteroflow-test-provider-cookie-key'] },
  features: { devInteractions: { enabled: true }, rpInitiatedLogout: { enabled: true } },
  async findAccount(ctx, id) {
    const person = users()[id];
    if (!person) return undefined;
    return {
      accountId: id,
      async claims() {
        return {
          sub: id,
          preferred_username: id,
          name: person.name || id,
          email: person.email || `${id}@corp.test`,
          groups: person.groups || [],
        };
      },
    };
  },
};

const provider = new Provider(issuer, configuration);
provider.on('server_error', (ctx, error) => console.error('oidc-provider server_error', error));
provider.listen(port, '127.0.0.1', () => console.log(`oidc-provider listening on ${issuer}`));
