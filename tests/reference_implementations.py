"""Plain implementations the tests hold the scripts' pieces against, by family: PPO, Q-learning (PQN), the
distributional and prioritized pieces (C51's projection, Rainbow's sum tree and n-step returns), the ensembles of
critics, IMPALA. Written for reading, not speed: loops over steps and rows, torch's own modules and distributions.

The rule: each is written plainly from the paper or CleanRL's script, never from ours (a reference copied from the
script it checks shares its mistakes). Where a piece is a rule over the script's networks, the reference takes them
as arguments and uses only their layers."""

import math

import numpy as np
import torch
import torch.nn.functional as F

# PPO


def reference_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    """CleanRL's reverse loop."""
    advantages, last = torch.zeros_like(rewards), 0
    for t in reversed(range(len(rewards))):
        if t == len(rewards) - 1:
            next_nonterminal, next_values = 1.0 - next_done, next_value
        else:
            next_nonterminal, next_values = 1.0 - dones[t + 1], values[t + 1]
        delta = rewards[t] + gamma * next_values * next_nonterminal - values[t]
        advantages[t] = last = delta + gamma * gae_lambda * next_nonterminal * last
    return advantages, advantages + values


def plain_ppo_step(agent, optimizer, minibatch, clip_coef=0.1, ent_coef=0.01, vf_coef=0.5, max_grad_norm=0.5):
    """CleanRL's minibatch step, written plainly: torch.distributions, a float learning rate, torch's default Adam."""
    obs, actions, logprobs, advantages, returns, values = minibatch
    hidden = agent.network(obs / 255.0)
    distribution = torch.distributions.Categorical(logits=agent.actor(hidden))
    new_value = agent.critic(hidden).view(-1)
    ratio = (distribution.log_prob(actions) - logprobs).exp()
    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    pg_loss = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)).mean()
    clipped_value = values + torch.clamp(new_value - values, -clip_coef, clip_coef)
    v_loss = 0.5 * torch.max((new_value - returns) ** 2, (clipped_value - returns) ** 2).mean()
    loss = pg_loss - ent_coef * distribution.entropy().mean() + vf_coef * v_loss
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(agent.parameters(), max_grad_norm)
    optimizer.step()
    return {"policy_loss": pg_loss, "value_loss": v_loss}


def reference_ppo_update(agent, minibatches, max_grad_norm, clip_coef=0.1, ent_coef=0.01, vf_coef=0.5):
    """CleanRL's PPO update of one process, minibatch after minibatch: the advantages normalised over the minibatch,
    the mean loss, clipping, Adam. Returns each minibatch's gradient norm."""
    optimizer, grad_norms = torch.optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5), []
    for obs, actions, logprobs, advantages, returns, values in minibatches:
        logits = agent.actor(agent.hidden(obs))
        dist_ = torch.distributions.Categorical(logits=logits)
        new_value = agent.critic(agent.hidden(obs)).squeeze(-1)
        ratio = (dist_.log_prob(actions) - logprobs).exp()
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        pg_loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip_coef, 1 + clip_coef)).mean()
        clipped_value = values + (new_value - values).clamp(-clip_coef, clip_coef)
        v_loss = 0.5 * torch.max((new_value - returns) ** 2, (clipped_value - returns) ** 2).mean()
        loss = pg_loss - ent_coef * dist_.entropy().mean() + vf_coef * v_loss
        optimizer.zero_grad()
        loss.backward()
        grad_norms.append(torch.nn.utils.clip_grad_norm_(agent.parameters(), max_grad_norm))
        optimizer.step()
    return torch.stack(grad_norms)


def reference_lstm_outputs(lstm, features, h, c, starts):
    """The loop written out cell by cell with nn.LSTMCell's math, independent of the script."""
    weight_ih, weight_hh = lstm.weight_ih_l0, lstm.weight_hh_l0
    bias = lstm.bias_ih_l0 + lstm.bias_hh_l0
    h, c, outputs = h[0], c[0], []
    for feature, start in zip(features, starts):
        h, c = h * (1 - start[:, None]), c * (1 - start[:, None])
        gates = feature @ weight_ih.T + h @ weight_hh.T + bias
        i, f, g, o = gates.chunk(4, -1)
        c = f.sigmoid() * c + i.sigmoid() * g.tanh()
        h = o.sigmoid() * c.tanh()
        outputs.append(h)
    return torch.stack(outputs)


def reference_ppo_lstm_loss(agent, minibatch, clip_coef=0.1, ent_coef=0.01, vf_coef=0.5):
    """CleanRL's PPO-LSTM loss on the steps CleanRL's wrappers would have stored: the restarts removed before any
    mean or standard deviation is taken, the state zeroed at each episode's first frame (the cell-by-cell loop)."""
    hidden = reference_lstm_outputs(
        agent.lstm, agent.features(minibatch.obs), minibatch.initial_h, minibatch.initial_c, minibatch.starts
    )
    kept = minibatch.dones == 0
    logits = agent.actor(hidden)[kept]
    new_logprob = torch.distributions.Categorical(logits=logits).log_prob(minibatch.actions[kept])
    entropy = torch.distributions.Categorical(logits=logits).entropy()
    new_value = agent.critic(hidden).squeeze(-1)[kept]
    advantages, returns, values = (t[kept] for t in (minibatch.advantages, minibatch.returns, minibatch.values))
    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    ratio = (new_logprob - minibatch.logprobs[kept]).exp()
    pg_loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip_coef, 1 + clip_coef)).mean()
    clipped_value = values + (new_value - values).clamp(-clip_coef, clip_coef)
    v_loss = 0.5 * torch.max((new_value - returns) ** 2, (clipped_value - returns) ** 2).mean()
    return pg_loss - ent_coef * entropy.mean() + vf_coef * v_loss, {"entropy": entropy.mean().detach()}


# Q-learning (PQN)


def reference_q_lambda(rewards, values, dones, next_value, next_done, gamma, q_lambda):
    """CleanRL's reverse loop (pqn.py, pqn_atari_envpool.py)."""
    returns = torch.zeros_like(rewards)
    for t in reversed(range(len(rewards))):
        if t == len(rewards) - 1:
            returns[t] = rewards[t] + gamma * next_value * (1.0 - next_done)
        else:
            next_nonterminal = 1.0 - dones[t + 1]
            mixed = q_lambda * returns[t + 1] + (1 - q_lambda) * values[t + 1]
            returns[t] = rewards[t] + gamma * mixed * next_nonterminal
    return returns


def plain_pqn_step(q_network, optimizer, obs, actions, returns, max_grad_norm=10.0):
    """CleanRL's minibatch step, written plainly: a float learning rate and torch's default RAdam."""
    old_val = q_network(obs).gather(1, actions.unsqueeze(-1).long()).squeeze()
    loss = F.mse_loss(returns, old_val)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(q_network.parameters(), max_grad_norm)
    optimizer.step()
    return {"td_loss": loss, "q_values": old_val.mean()}


# Distributional and prioritized (C51, Rainbow, FastTD3's critics)


def plain_projection(atoms, probs, support):
    """CleanRL's projection (rainbow_atari.py, c51_atari.py): floor and ceiling, index_add_ one row at a time."""
    v_min, v_max, n_atoms = support[0].item(), support[-1].item(), len(support)
    delta_z = (v_max - v_min) / (n_atoms - 1)
    b = (atoms.clamp(v_min, v_max) - v_min) / delta_z
    lower, upper = b.floor().clamp(0, n_atoms - 1), b.ceil().clamp(0, n_atoms - 1)
    d_m_l = (upper + (lower == b).float() - b) * probs
    d_m_u = (b - lower) * probs
    target = torch.zeros_like(probs)
    for i in range(len(probs)):
        target[i].index_add_(0, lower[i].long(), d_m_l[i])
        target[i].index_add_(0, upper[i].long(), d_m_u[i])
    return target


class PlainSumTree:
    """A binary sum tree as CleanRL's (after OpenAI baselines'): the root at 0, children 2i+1 and 2i+2, one item
    written and one value found at a time. Its leaves are in order only for a power of two of them."""

    def __init__(self, capacity):
        self.capacity = 2 ** math.ceil(math.log2(capacity))
        self.tree = np.zeros(2 * self.capacity - 1)

    def update(self, index, value):
        node = index + self.capacity - 1
        self.tree[node] = value
        while node > 0:
            node = (node - 1) // 2
            self.tree[node] = self.tree[2 * node + 1] + self.tree[2 * node + 2]

    def retrieve(self, value):
        node = 0
        while 2 * node + 1 < len(self.tree):
            left = 2 * node + 1
            if value <= self.tree[left]:
                node = left
            else:
                value -= self.tree[left]
                node = left + 1
        return node - (self.capacity - 1)

    def leaf(self, index):
        return self.tree[index + self.capacity - 1]


def plain_n_step(lane_stream, t, n_step, gamma):
    """The n-step transition from step t, one step at a time: (return, bootstrap discount, bootstrap obs)."""
    total, discount = 0.0, 1.0
    for j in range(n_step):
        total += discount * lane_stream["rewards"][t + j]
        discount *= gamma
        if lane_stream["terminations"][t + j]:
            return total, 0.0, lane_stream["obs"][t + j + 1]
        if lane_stream["ends"][t + j]:  # a truncation: the reset step's row holds the last observation
            return total, discount, lane_stream["obs"][t + j + 1]
    return total, discount, lane_stream["obs"][t + n_step]


def plain_critic_logits(qnet, k, obs, actions):
    """Critic k of FastTD3's ensemble as separate layers: its logits."""
    x = torch.cat([obs, actions], -1)
    linears = [layer for layer in qnet.members[k].net if isinstance(layer, torch.nn.Linear)]
    for i, linear in enumerate(linears):
        x = (torch.relu(x) if i else x) @ linear.weight.T + linear.bias
    return x


# Ensembles of critics (SAC, TD3)


def plain_critics(qnet, obs_dim, act_dim):
    """The ensemble's members as separate plain critics (the script's critic class) holding copies of their weights."""
    critics = [type(member)(obs_dim, act_dim) for member in qnet.members]
    for member, critic in zip(qnet.members, critics):
        critic.load_state_dict(member.state_dict())
    return critics


# IMPALA


def vtrace_reference(log_rhos, discounts, rewards, values, bootstrap_value, rho_clip, pg_rho_clip, c_clip):
    """Espeholt et al. 2018, eq. 1, in float64: vs_t = V(x_t) + sum_{s=t}^{T-1} (prod_{i=t}^{s-1} gamma_i c_i)
    rho_s delta_s, with delta_s = r_s + gamma_s V(x_{s+1}) - V(x_s), each term summed on its own (O(T^2))."""
    rhos = np.exp(log_rhos)
    next_values = np.concatenate([values[1:], bootstrap_value[None]])
    T = len(rhos)
    vs = values.copy()
    for t in range(T):
        for s in range(t, T):
            trace = np.prod(discounts[t:s] * np.minimum(c_clip, rhos[t:s]), axis=0)
            vs[t] += trace * np.minimum(rho_clip, rhos[s]) * (rewards[s] + discounts[s] * next_values[s] - values[s])
    next_vs = np.concatenate([vs[1:], bootstrap_value[None]])
    return vs, np.minimum(pg_rho_clip, rhos) * (rewards + discounts * next_vs - values)


def core_step_by_step(agent, obs, state, dones):
    """The actors' way through IMPALA's LSTM core: one step at a time, the state zeroed after a step that ends an
    episode."""
    logits, values = [], []
    for t in range(len(obs)):
        step_logits, step_values, state = agent(obs[t], state)
        logits.append(step_logits)
        values.append(step_values)
        if t < len(dones):
            keep = (1.0 - dones[t]).view(1, -1, 1)
            state = tuple(part * keep for part in state)
    return torch.stack(logits), torch.stack(values)
